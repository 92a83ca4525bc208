"""The fast path's projection GEMMs over a few rows (a decoding step, a verify forward) as one Triton kernel.

At batch 1 a projection multiplies 1-16 rows with a weight that is read once from memory. cuBLAS picks tiles made
for wider products there, and on an H200 its fused gate/up GEMM of a Qwen3-4B-shaped model took 29.6 µs where the
weight's bytes take 24 (`benchmarks/decode_gemm_micro.py`). Here each program owns `BLOCK_N` output columns, walks
the whole reduction (no split-K, so no second kernel to add the parts) and streams its slice of the weight once,
evicting it first from the cache; every row of the input is multiplied with the same weight tile. Products
accumulate in float32 and round once to the output's dtype, as cuBLAS rounds them; the order of the sums differs,
so results agree to the dtype's rounding, not bit for bit.

Used inside `fused_projections.projection_fusion()` (the fast path) by the fused groups and the single projections
for 16-bit weights on CUDA with at most `MAX_ROWS` rows (a wider batch keeps cuBLAS), when `DSPARK_SKINNY_LINEAR=1`
is in the environment (`fused`: the fused groups only, o and down keep cuBLAS; read when a forward is traced); off
by default.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..verify import triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: without Triton the projections call F.linear
    triton = None

__all__ = ["MAX_ROWS", "linear", "skinny_linear_applies"]

MAX_ROWS = 16  # one dot tile of rows
SWITCH_VARIABLE = "DSPARK_SKINNY_LINEAR"  # "1": the kernel where it applies; "fused": for fused groups only; "0": off
DEFAULT = "0"  # off until a GPU run shows it pays (the kernel is timed against cuBLAS on the GPU machine)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    @triton.jit
    def _skinny_linear(
        x_ptr, w_ptr, bias_ptr, out_ptr, rows, columns, depth, s_x, s_w, s_out,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """out[:, n] = x @ w[n].T (+ bias[n]) for this program's BLOCK_N columns n."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < columns
        row_ids = tl.arange(0, BLOCK_M)
        row_ok = row_ids < rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, depth, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < depth
            weight = tl.load(w_ptr + cols[:, None] * s_w + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                             other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + row_ids[:, None] * s_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            if IEEE:  # the interpreter's 16-bit dot is not exact: multiply in float32
                acc = tl.dot(x.to(tl.float32), tl.trans(weight.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(weight), acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + row_ids[:, None] * s_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def tiles(columns: int, depth: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a weight [columns, depth]: narrow column tiles where the weight is small, so that
    enough programs share the reads."""
    block_n = 32 if columns >= 8192 else 64 if columns * depth >= 1 << 22 else 16
    block_k = 128 if depth >= 1024 else 64
    return block_n, block_k


@torch.library.custom_op("dspark_hf::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., K] of at most MAX_ROWS rows and a weight [N, K] with unit column
    stride; an opaque operator to torch.compile, as the attention kernel is."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    rows, depth = flat.shape
    columns = weight.shape[0]
    # (the interpreter casts float32 to bfloat16 by truncation: it stores float32, and torch rounds as the GPU does)
    out = torch.empty(rows, columns, dtype=torch.float32 if INTERPRETED else x.dtype, device=x.device)
    block_n, block_k = tiles(columns, depth)
    _skinny_linear[(triton.cdiv(columns, block_n),)](
        flat, weight, bias if bias is not None else weight, out, rows, columns, depth,
        flat.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=INTERPRETED,
        num_warps=4, num_stages=3,
    )
    return out.to(x.dtype).view(*x.shape[:-1], columns)


@skinny_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def skinny_linear_applies(x: torch.Tensor, weight: torch.Tensor, fused: bool = True) -> bool:
    """Whether `linear` runs the kernel: 16-bit weights and input on a Triton device, at most MAX_ROWS rows, and
    `DSPARK_SKINNY_LINEAR=1` (or `fused`, for a fused group's weight: `fused=True`; off by default)."""
    switch = os.environ.get(SWITCH_VARIABLE, DEFAULT)
    return (triton is not None and (switch == "1" or (switch == "fused" and fused))
            and weight.dtype in (torch.float16, torch.bfloat16) and x.dtype == weight.dtype
            and x.numel() <= MAX_ROWS * x.shape[-1] and weight.stride(1) == 1 and x.device == weight.device
            and triton_available(x.device))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fused: bool = True) -> torch.Tensor:
    """`F.linear`, through the kernel where `skinny_linear_applies` (`fused`: the weight is a fused group's)."""
    if skinny_linear_applies(x, weight, fused):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
