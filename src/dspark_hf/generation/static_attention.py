"""Attention over static KV caches for the fast path: a split-KV Triton kernel registered as a transformers
attention implementation (`"dspark_static"`).

On a static cache a decoding step attends a few queries (1 for plain decoding, γ + 1 when verifying, γ in the
drafter) to a fixed-length K/V buffer under a mask. SDPA then runs cuDNN or memory-efficient attention, whose
programs each walk a head's whole K/V: with 8 K/V heads at batch 1 that is 8 busy SMs of 132. On an H200 the
memory-efficient kernel took about 16 µs per layer for 8 queries at a 4B shape
(benchmarks/results/static_round_profile_h200.json), some 10 % of a DSpark round. This kernel gives every program
one K/V head and a slice of the cache, with all the head's query rows (its GQA group × queries) in one tile, and a
second kernel merges the slices (flash-decoding). A tile of keys that the mask hides from every query row of the
program (left padding, columns not written yet, a drafter's longer cache) is not read: with 256 rows of a Qwen3-4B
shape, attention over every column took a fifth of a round's GPU time (benchmarks/results/plain_round_tax_h200.json).
Finding out still loads the tile's mask (on the H200 about 1.1 µs a call per hidden tile at 128 rows against some
15 µs per visible one, benchmarks/results/attention_hidden_tiles_h200.json), so a caller that knows each row's range
of visible keys passes it (`key_bounds`, as the static batch's target forwards do) and the tiles outside are not
visited at all (0.00 µs per hidden tile on the H200).

The semantics are transformers' `sdpa_attention_forward`: the mask is a boolean (True: attend) or an additive float
mask broadcastable to [B, 1, Q, K]; without one, Q > 1 is causal (SDPA's top-left alignment) unless the module says
`is_causal = False`; an additive mask's lowest finite value (what transformers' masks use) hides a key as -inf
does, and a query row that sees no key gets zeros. Anything the kernel does not cover (dropout, a sliding window,
soft-capping, a head size that is not a power of two, more than `MAX_ROWS` query rows per K/V head as in a prefill,
no Triton, a CPU tensor outside the Triton interpreter) runs SDPA instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..verify import triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernel is optional: without Triton every call runs SDPA
    triton = None

__all__ = ["STATIC_ATTENTION", "static_cache_attention", "using_static_attention"]

STATIC_ATTENTION = "dspark_static"
BLOCK_N = 64  # keys per tile
MAX_ROWS = 64  # query rows (GQA group × queries) per program; more (a prefill) runs SDPA
MASK_NONE, MASK_BOOL, MASK_ADDITIVE = 0, 1, 2


if triton is not None:

    @triton.jit
    def _query_rows(pid, num_kv_heads, num_queries, GROUP: tl.constexpr, ROWS: tl.constexpr):
        """Program `pid`'s batch row and K/V head, and its tile rows: row r is query r % Q of head
        kv_head · GROUP + r // Q (rows past GROUP · Q are padding)."""
        b = pid // num_kv_heads
        kv_head = pid % num_kv_heads
        rows = tl.arange(0, ROWS)
        return b, kv_head, rows, rows < GROUP * num_queries, kv_head * GROUP + rows // num_queries, rows % num_queries

    @triton.jit
    def _store_output(out_ptr, acc, total, b, query, head, row_ok, so_b, so_n, so_h, HEAD_DIM: tl.constexpr):
        """acc / total into out[b, query, head, :]; a row without keys (padding) gets 0."""
        dims = tl.arange(0, HEAD_DIM)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + b * so_b + query[:, None] * so_n + head[:, None] * so_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _attend_slice(
        q_ptr, k_ptr, v_ptr, mask_ptr, bounds_ptr, out_ptr, part_ptr, stat_ptr,
        sq_b, sq_h, sq_n, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_n, sm_l, so_b, so_n, so_h,
        num_kv_heads, num_queries, kv_length, keys_per_slice, scale, masked_at,
        GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
        MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, SLICES: tl.constexpr, IEEE: tl.constexpr,
        BOUNDED: tl.constexpr,
    ):
        """One (batch row, K/V head, cache slice): all GROUP × num_queries query rows against the slice's keys,
        online softmax. One slice: the normalised output; several: the slice's (max, sum, accumulator). An additive
        mask's values <= `masked_at` hide their key; a tile of keys hidden from every query row is skipped.
        `BOUNDED`: the row's keys outside [bounds[b, 0], bounds[b, 1]) are not visited at all (whole tiles)."""
        pid = tl.program_id(0)
        part = tl.program_id(1)
        b, kv_head, rows, row_ok, head, query = _query_rows(pid, num_kv_heads, num_queries, GROUP, ROWS)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + query[:, None] * sq_n + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        start = part * keys_per_slice
        end = tl.minimum(start + keys_per_slice, kv_length)
        if BOUNDED:  # (start stays on a tile boundary: whole tiles are loaded as before)
            first_key = tl.load(bounds_ptr + 2 * b).to(tl.int32)
            start = tl.maximum(start, first_key - first_key % BLOCK)
            end = tl.minimum(end, tl.load(bounds_ptr + 2 * b + 1).to(tl.int32))
        for first in range(start, end, BLOCK):
            keys = first + tl.arange(0, BLOCK)
            key_ok = keys < end
            ok = row_ok[:, None] & key_ok[None, :]
            bias = tl.zeros([ROWS, BLOCK], tl.float32)
            if MASK_KIND == 1:
                keep = tl.load(mask_ptr + b * sm_b + query[:, None] * sm_n + keys[None, :] * sm_l, mask=ok, other=0)
                ok = ok & (keep != 0)
            if MASK_KIND == 2:
                bias = tl.load(mask_ptr + b * sm_b + query[:, None] * sm_n + keys[None, :] * sm_l, mask=ok,
                               other=0.0).to(tl.float32)
                ok = ok & (bias > masked_at)
            if CAUSAL:
                ok = ok & (keys[None, :] <= query[:, None])  # SDPA's is_causal: top-left aligned
            if tl.sum(ok.to(tl.int32)) > 0:  # a tile no query row sees (padding, unwritten columns) is not read
                k = tl.load(k_ptr + b * sk_b + kv_head * sk_h + keys[:, None] * sk_l + dims[None, :],
                            mask=key_ok[:, None], other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = tl.where(ok, (s * scale).to(tl.float32) + bias, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf) = 0 below
                p = tl.exp(s - shift[:, None])
                alpha = tl.exp(m - shift)
                total = total * alpha + tl.sum(p, axis=1)
                v = tl.load(v_ptr + b * sv_b + kv_head * sv_h + keys[:, None] * sv_l + dims[None, :],
                            mask=key_ok[:, None], other=0.0)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
        if SLICES == 1:
            _store_output(out_ptr, acc, total, b, query, head, row_ok, so_b, so_n, so_h, HEAD_DIM)
        else:
            base = (pid * SLICES + part) * ROWS
            tl.store(part_ptr + (base + rows[:, None]) * HEAD_DIM + dims[None, :], acc)
            tl.store(stat_ptr + 2 * (base + rows), m)
            tl.store(stat_ptr + 2 * (base + rows) + 1, total)

    @triton.jit
    def _merge_slices(
        out_ptr, part_ptr, stat_ptr, so_b, so_n, so_h, num_kv_heads, num_queries,
        GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, SLICES: tl.constexpr,
    ):
        """Combines one (batch row, K/V head)'s slices: rescale each to the common maximum and normalise."""
        pid = tl.program_id(0)
        b, kv_head, rows, row_ok, head, query = _query_rows(pid, num_kv_heads, num_queries, GROUP, ROWS)
        dims = tl.arange(0, HEAD_DIM)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        for part in range(SLICES):
            m = tl.maximum(m, tl.load(stat_ptr + 2 * ((pid * SLICES + part) * ROWS + rows)))
        shift = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for part in range(SLICES):
            base = (pid * SLICES + part) * ROWS
            weight = tl.exp(tl.load(stat_ptr + 2 * (base + rows)) - shift)
            total += weight * tl.load(stat_ptr + 2 * (base + rows) + 1)
            acc += weight[:, None] * tl.load(part_ptr + (base + rows[:, None]) * HEAD_DIM + dims[None, :])
        _store_output(out_ptr, acc, total, b, query, head, row_ok, so_b, so_n, so_h, HEAD_DIM)


_SM_COUNTS: dict[int | None, int] = {}  # CUDA device index -> multiprocessors


def _sm_count(device: torch.device) -> int:
    """The device's multiprocessors (4 off CUDA)."""
    if device.type != "cuda":
        return 4
    if device.index not in _SM_COUNTS:
        index = device.index if device.index is not None else torch.cuda.current_device()
        _SM_COUNTS[device.index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[device.index]


def _kernel_covers(query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict) -> bool:
    """Whether the kernel handles this call (see the module docstring); otherwise SDPA runs it."""
    head_dim = query.shape[-1]
    rows = query.shape[1] // max(1, key.shape[1]) * query.shape[2]
    return (rows <= MAX_ROWS and triton_available(query.device) and dropout == 0.0
            and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False)
            and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and key.shape[-1] == head_dim
            and query.shape[1] % key.shape[1] == 0 and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and key.dtype == query.dtype)


def static_cache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: `query` [B, Hq, Q, D], `key` / `value` [B, Hkv, K, D] -> ([B, Q, Hq, D],
    None), as `sdpa_attention_forward` computes it (see the module docstring). `key_bounds` (a keyword the model's
    forward passes through to its attention): [B, 2], per batch row the first key any of its queries may see and one
    past the last; the kernel does not visit the keys outside (the mask must hide them), SDPA ignores it."""
    key_bounds = kwargs.pop("key_bounds", None)
    if not _kernel_covers(query, key, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    return split_kv_attention(query, key, value, attention_mask, causal, scale, key_bounds), None


@torch.library.custom_op("dspark_hf::split_kv_attention", mutates_args=())
def split_kv_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                       causal: bool, scale: float, key_bounds: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' launch, an opaque operator to torch.compile. Inductor traced the launches of the user-defined
    kernels itself before, and in the compiled engine rounds on an H200 the split path (several slices, merged by
    a second kernel) then gave wrong attention: about 6 % of the drafts at batch 1 equalled the eager ones, with
    and without CUDA graphs, bf16 and float32, while one slice and eager launches were right
    (docs/serving.md). As a custom operator the launches run as written, in order."""
    batch, num_heads, num_queries, head_dim = query.shape
    num_kv_heads, kv_length = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    mask_kind, mask_strides, masked_at = MASK_NONE, (0, 0, 0), 0.0
    if mask is None:
        mask = query
    else:
        mask = mask.expand(batch, 1, num_queries, kv_length)
        mask_kind = MASK_BOOL if mask.dtype == torch.bool else MASK_ADDITIVE
        mask_strides = (mask.stride(0), mask.stride(2), mask.stride(3))
        if mask_kind == MASK_ADDITIVE:  # the lowest finite value masks like -inf (transformers' masks use it)
            masked_at = torch.finfo(mask.dtype).min
    rows = max(16, triton.next_power_of_2(group * num_queries))
    tiles = triton.cdiv(kv_length, BLOCK_N)
    programs = batch * num_kv_heads
    slices = min(tiles, max(1, _sm_count(query.device) // programs))
    keys_per_slice = triton.cdiv(tiles, slices) * BLOCK_N
    slices = triton.cdiv(kv_length, keys_per_slice)
    out = query.new_empty(batch, num_queries, num_heads, head_dim)
    parts = stats = out
    if slices > 1:
        parts = torch.empty(programs * slices * rows * head_dim, device=query.device, dtype=torch.float32)
        stats = torch.empty(programs * slices * rows * 2, device=query.device, dtype=torch.float32)
    if key_bounds is not None:  # (the kernel reads row b's bounds at 2 b and 2 b + 1)
        key_bounds = key_bounds.contiguous()
    _attend_slice[(programs, slices)](
        query, key, value, mask, key_bounds if key_bounds is not None else query, out, parts, stats,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), *mask_strides, out.stride(0), out.stride(1), out.stride(2),
        num_kv_heads, num_queries, kv_length, keys_per_slice, scale, masked_at,
        GROUP=group, ROWS=rows, HEAD_DIM=head_dim, BLOCK=BLOCK_N, MASK_KIND=mask_kind, CAUSAL=causal,
        SLICES=slices, IEEE=query.dtype == torch.float32, BOUNDED=key_bounds is not None,
    )
    if slices > 1:
        _merge_slices[(programs,)](out, parts, stats, out.stride(0), out.stride(1), out.stride(2), num_kv_heads,
                                   num_queries, GROUP=group, ROWS=rows, HEAD_DIM=head_dim, SLICES=slices)
    return out


@split_kv_attention.register_fake
def _(query, key, value, mask, causal, scale, key_bounds=None):
    batch, num_heads, num_queries, head_dim = query.shape
    return query.new_empty(batch, num_queries, num_heads, head_dim)


AttentionInterface.register(STATIC_ATTENTION, static_cache_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(STATIC_ATTENTION, sdpa_mask)  # the same boolean masks SDPA receives


@contextlib.contextmanager
def using_static_attention(*models: torch.nn.Module | None) -> Iterator[None]:
    """Runs the block with `models`' attention (their configs' `_attn_implementation`) set to the static-cache
    kernel; restores what was there afterwards."""
    configs = [model.config for model in models if model is not None]
    saved = [config._attn_implementation for config in configs]
    try:
        for config in configs:
            config._attn_implementation = STATIC_ATTENTION
        yield
    finally:
        for config, name in zip(configs, saved):
            config._attn_implementation = name
