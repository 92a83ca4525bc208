"""Verify-length scheduling: profiled SPS tables and per-request verify-length policies (pure torch)."""

from .policies import (
    POLICY_NAMES,
    SchedulerPolicy,
    SPSLike,
    async_capacity,
    fixed_length,
    get_policy,
    hardware_aware_async,
    hardware_aware_sync,
    static_threshold,
    top_k_prefix,
)
from .guard import SpeculationGuard
from .round_widths import RoundWidthChooser
from .sps import SPSTable

__all__ = [
    "POLICY_NAMES",
    "RoundWidthChooser",
    "SPSLike",
    "SPSTable",
    "SchedulerPolicy",
    "SpeculationGuard",
    "async_capacity",
    "fixed_length",
    "get_policy",
    "hardware_aware_async",
    "hardware_aware_sync",
    "static_threshold",
    "top_k_prefix",
]
