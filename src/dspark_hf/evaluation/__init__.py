"""Measuring DSpark against plain decoding and calibrating it: speed, accepted length, confidence calibration."""

from .calibrate import ConfidenceRecords, calibrate_drafter, collect_confidence_records
from .compare import Comparison, compare_generation
from .harness import TaskRun, evaluate_task, run_evaluation
from .plots import plot_report
from .prompts import encode_prompt, load_prompts
from .tasks import TASKS, load_task

__all__ = [
    "TASKS",
    "TaskRun",
    "evaluate_task",
    "load_task",
    "plot_report",
    "run_evaluation",
    "Comparison",
    "ConfidenceRecords",
    "calibrate_drafter",
    "collect_confidence_records",
    "compare_generation",
    "encode_prompt",
    "load_prompts",
]
