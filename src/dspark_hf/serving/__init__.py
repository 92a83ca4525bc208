"""Serving many requests: `DSparkEngine` (continuous batching, per-request verify lengths, streaming, cancellation)."""

from .engine import DSparkEngine, RequestSampler
from .requests import Request, RequestOutput, SamplingParams

__all__ = ["DSparkEngine", "Request", "RequestOutput", "RequestSampler", "SamplingParams"]
