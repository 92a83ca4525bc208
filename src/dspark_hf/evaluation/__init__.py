"""Measuring DSpark against plain decoding and calibrating it: speed, accepted length, confidence calibration."""

from .calibrate import ConfidenceRecords, calibrate_drafter, collect_confidence_records
from .compare import Comparison, compare_generation
from .prompts import encode_prompt, load_prompts

__all__ = [
    "Comparison",
    "ConfidenceRecords",
    "calibrate_drafter",
    "collect_confidence_records",
    "compare_generation",
    "encode_prompt",
    "load_prompts",
]
