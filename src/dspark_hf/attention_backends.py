"""Attention backend order for decoding loops: cuDNN attention last.

On an H200 with torch 2.11, `scaled_dot_product_attention` ran cuDNN attention in our profiles
(benchmarks/results/engine_profile_h200.txt), and cuDNN builds an execution plan for every input shape it has not
seen (reported by other projects, e.g. modelscope/FunASR issue 3704). A decoding loop changes the shape almost every
round: the KV length grows, and the padding mask of a batch changes. So every round may pay a plan build. On the
H200 the engine's rounds took about 15-65 ms longer than the same forward at shapes an earlier run had already seen,
for the 50M fixture and a 4B shape alike, which is what per-shape plan builds would cost. Under this context the
no-speculation engine's median round on the 50M fixture fell from 49-79 ms to 7-12 ms in the same serving benchmark
(docs/serving.md); `benchmarks/engine_profile.py --compare-plain` isolates the effect further (not yet run). Flash
and memory-efficient attention need no per-shape plan.

`decoding_attention()` keeps every backend that is enabled and only moves cuDNN to the end of the priority order,
for the duration of the block. DSpark's loops (`generate(assistant_model=...)`, batched generation, the engine) run
under it. Use it around a plain `generate()` baseline so that both sides of a comparison use the same kernels.
`DSPARK_KEEP_SDPA_ORDER=1` in the environment turns it off (torch's own order everywhere).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

_PREFERRED = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
              SDPBackend.OVERRIDEABLE, SDPBackend.CUDNN_ATTENTION)
_HAS_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters  # older torch has no priority order


_ENABLED = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
            SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
            SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
            SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
            # no public getter for this one
            SDPBackend.OVERRIDEABLE: getattr(torch._C, "_get_overrideable_sdp_enabled", lambda: True)}


def _enabled(backend: SDPBackend) -> bool:
    return bool(_ENABLED[backend]())


@contextlib.contextmanager
def decoding_attention() -> Iterator[None]:
    """Runs the block with cuDNN attention at the end of torch's SDPA priority order (see the module docstring).
    The set of enabled backends is unchanged; torch versions without priorities leave cuDNN out instead, unless
    it is the only backend enabled.

    With priorities it sets and restores only the order (what `sdpa_kernel(enabled, set_priority=True)` would set,
    whose saving and setting of every backend's flag cost the engine about 17 of its 29 µs a round on the
    development CPU)."""
    enabled = [backend for backend in _PREFERRED if _enabled(backend)]
    if os.environ.get("DSPARK_KEEP_SDPA_ORDER") == "1":
        context = contextlib.nullcontext()
    elif _HAS_PRIORITY:
        context = _priority_order([int(backend) for backend in enabled])
    elif SDPBackend.CUDNN_ATTENTION in enabled and len(enabled) > 1:
        context = sdpa_kernel([backend for backend in enabled if backend != SDPBackend.CUDNN_ATTENTION])
    else:
        context = contextlib.nullcontext()
    with context:
        yield


@contextlib.contextmanager
def _priority_order(first: list[int]) -> Iterator[None]:
    """torch's SDPA priority order with `first` ahead of the other backends (in their order), then the order before."""
    previous = torch._C._get_sdp_priority_order()
    order = first + [backend for backend in previous if backend not in first]
    if order == list(previous):
        yield
        return
    torch._C._set_sdp_priority_order(order)
    try:
        yield
    finally:
        torch._C._set_sdp_priority_order(previous)
