"""Confidence calibration: Sequential Temperature Scaling (fit/apply), ECE / ROC-AUC / Brier, reliability diagrams."""

from .metrics import (
    DEFAULT_NUM_BINS,
    apply_sts,
    brier_score,
    calibration_metrics,
    cumulative_survival,
    expected_calibration_error,
    reliability_curve,
    roc_auc,
)
from .plots import reliability_diagram
from .sts import default_grid, fit_sts

__all__ = [
    "DEFAULT_NUM_BINS",
    "apply_sts",
    "brier_score",
    "calibration_metrics",
    "cumulative_survival",
    "default_grid",
    "expected_calibration_error",
    "fit_sts",
    "reliability_curve",
    "reliability_diagram",
    "roc_auc",
]
