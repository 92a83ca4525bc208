"""Waiting for a device: shared by everything that times device work (SPS profiling, the round profiler, timed
`generate()` calls)."""

from __future__ import annotations

import torch


def synchronize(device: torch.device | str) -> None:
    """Waits for `device`'s queued work (CUDA, XPU, MPS; a no-op on the CPU), so that wall-clock timings cover it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu" and hasattr(torch, "xpu"):
        torch.xpu.synchronize(device)
    elif device.type == "mps" and hasattr(torch, "mps"):
        torch.mps.synchronize()
