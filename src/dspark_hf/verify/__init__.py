"""Lossless speculative verification for ragged batches (torch reference + Triton kernel).

Entry point: :func:`verify`; see ``docs/verify.md``.
"""

from .api import VerifyResult, triton_available, verify

__all__ = ["VerifyResult", "verify", "triton_available"]
