"""Measuring DSpark against plain decoding: speed, accepted length, acceptance per position."""

from .compare import Comparison, compare_generation

__all__ = ["Comparison", "compare_generation"]
