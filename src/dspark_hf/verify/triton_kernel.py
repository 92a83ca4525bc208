"""Triton backend of :func:`dspark_hf.verify.verify`.

Launches (all asynchronous, no host synchronisation, no torch kernels in between):

1. ``_filter_kernel`` (only when top_k / top_p is given), one program per target row: an
   exact 16-way radix search over order-preserving float32 keys finds the top-k value and
   then the top-p threshold (8 rounds each; rows without an active filter exit at once). For a
   top k of at most the block size the searches read only the values at or above the k-th
   largest per-lane maximum, gathered in one pass (``FILTER_CANDIDATES`` at most), not the row.
2. ``_stats_kernel``, grid (requests, l + 1, vocab chunks): per chunk, for sampling rows the
   online softmax statistics of the processed logits (per-lane running max / sum-exp, one exp per
   element), for greedy rows the max and first argmax (no exp); unmasked full tiles, one masked
   tail tile.
3. ``_accept_race_kernel``, grid (requests, race chunks): each program merges the chunk statistics
   of its request's l_r + 1 rows, evaluates every acceptance test in parallel (counter-based
   uniforms) and takes the first rejection with a min-reduction (chunk 0 writes the accepted
   drafts and the greedy token); for sampling requests it then streams its chunk of the emit row
   once (logits and q row), one residual sum and one noise value per group of ``rng.RACE_GROUP``
   ids (the first level of the two-level exponential race, ``reference.group_race``); the
   request's last program to finish (a ticket counter that kernel 2 zeroes) races the ids of the
   best group and writes the token. On Hopper and later it is a programmatic dependent launch:
   its programs start during kernel 2's last wave, load their request's inputs and wait
   (``griddepcontrol.wait``) only before reading kernel 2's statistics.

Kernels 1-3 compute a request's flat offset ``sum(num_drafts[:r])`` themselves (a masked sum
over ``num_drafts``, ``OFF_BLOCK`` entries at a time), so no cumsum runs on the Triton path.

Launch shape of the two streaming kernels (2 and 3): :class:`LaunchConfig` (BLOCK, num_warps,
programs aimed for per SM, software-pipelining stages of the tile loop); the module default
is replaced with :func:`set_launch_config` or per call with ``verify_triton(p, config=...)``.
Runtime integers that change with the batch (chunk and tile counts, output width, strides of
per-request parameters) are not specialised, and the constexpr widths are powers of two, so a
new batch size or draft length compiles nothing new unless a power-of-two bucket changes.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from . import rng

OFF_BLOCK = 128  # num_drafts entries summed per step when a kernel computes a request's offset
FILTER_CANDIDATES = 2048  # values per row the top-k filter gathers before its searches


@dataclass(frozen=True)
class LaunchConfig:
    """Launch shape of ``_stats_kernel`` (every target row), ``_accept_race_kernel`` (emit rows;
    its tile is a race group, ``rng.RACE_GROUP`` ids) and ``_filter_kernel`` (one program per row to
    filter; no ``programs_per_sm``).

    ``*_block``: vocab entries per tile (power of two; capped at next_power_of_2(V)).
    ``*_warps``: num_warps. ``*_programs_per_sm``: the vocab is split into chunks so that about
    this many programs per SM are launched (at least one tile per chunk).
    ``*_stages``: ``tl.range(num_stages=...)`` software pipelining of the tile loads; 1 = a
    plain loop. ``dependent_launch``: on Hopper and later GPUs, launch the race kernel as a
    programmatic dependent of the stats kernel (its programs start during the stats kernel's last
    wave and wait for its end before reading the statistics). Results do not depend on the
    configuration beyond float32 rounding of the softmax denominators and of the top-p mass (the
    chunking and the filter's block change the summation order). The defaults come from H200 runs
    of ``benchmarks/verify_kernel.py --sweep`` (triton 3.6): stats from the sweep of 2026-11-30 (a
    later sweep's pick was within its noise on the two shapes it scores and slower at l = 15), filter
    from the sweep of 2026-12-01 (0.58 ms against 0.70 ms unpipelined at batch 64, l = 7, top-k 50 /
    top-p 0.9); race programs per SM and the dependent launch from a grid at batch 64, l 1-15, bf16
    and fp32 (2026-12-01, ``benchmarks/results/verify_kernel_diagnostics/verify_launch_grid_h200.json``:
    8 race programs per SM beat 16 by 1-4 us at l <= 7; the dependent launch saved 0-2 us)."""

    stats_block: int = 2048
    stats_warps: int = 4
    stats_programs_per_sm: int = 4
    stats_stages: int = 3
    race_warps: int = 4
    race_programs_per_sm: int = 8
    race_stages: int = 3
    filter_block: int = 256
    filter_warps: int = 4
    filter_stages: int = 3
    dependent_launch: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


_CONFIG = LaunchConfig()


def get_launch_config() -> LaunchConfig:
    """The configuration used when ``verify_triton`` gets no ``config``."""
    return _CONFIG


def set_launch_config(config: LaunchConfig | None) -> LaunchConfig:
    """Replace the module default (``None`` restores ``LaunchConfig()``); returns the previous one."""
    global _CONFIG
    prev = _CONFIG
    _CONFIG = config if config is not None else LaunchConfig()
    return prev


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, rng.MIX_C1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, rng.MIX_C2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _stream_key(seed, offset, STREAM: tl.constexpr):
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    off = (offset & 0xFFFFFFFF).to(tl.uint32)
    k = _mix32(lo + tl.full(lo.shape, rng.GOLDEN, tl.uint32))
    k = _mix32(k ^ hi)
    k = _mix32(k ^ off)
    return _mix32(k + tl.full(k.shape, (STREAM * rng.GOLDEN) & rng.MASK32, tl.uint32))


@triton.jit
def _uniform(key, counter):
    h = _mix32(counter.to(tl.uint32) ^ key)
    h = _mix32(h + key)
    return ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08


@triton.jit
def _exp1(u):
    """Exp(1) from u in (0, 1); same formula as ``rng.exponential_from_uniform``."""
    w = (u - 1.0) / (u + 1.0)
    w2 = w * w
    s = w2 * (1.0 / 15.0) + (1.0 / 13.0)
    s = s * w2 + (1.0 / 11.0)
    s = s * w2 + (1.0 / 9.0)
    s = s * w2 + (1.0 / 7.0)
    s = s * w2 + (1.0 / 5.0)
    s = s * w2 + (1.0 / 3.0)
    s = s * w2 + 1.0
    return tl.where(u >= 0.5, -2.0 * (w * s), -tl.log(u))


@triton.jit
def _key_of(s):
    b = s.to(tl.uint32, bitcast=True)
    return tl.where((b >> 31) != 0, b ^ 0xFFFFFFFF, b | 0x80000000)


@triton.jit
def _float_of(k):
    b = tl.where((k >> 31) != 0, k ^ 0x80000000, k ^ 0xFFFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _radix_search(base, V, temp, lo_key, m, bound, USE_MASS: tl.constexpr, BLOCK: tl.constexpr,
                  STAGES: tl.constexpr):
    """Smallest uint32 key K with  sum_{v: key_v > K, key_v >= lo_key} w_v  <  bound,
    w_v = exp(s_v - m) (USE_MASS) or 1."""
    probe_digits = tl.arange(0, 16).to(tl.uint32)
    prefix = tl.full((), 0, tl.uint32)
    for rnd in tl.static_range(8):
        shift = 28 - 4 * rnd
        low = tl.full((), (1 << shift) - 1, tl.uint32)
        probes = prefix | (probe_digits << shift) | low
        acc = tl.zeros([BLOCK, 16], dtype=tl.float32)  # per lane; reduced once after the pass
        for start in tl.range(0, V, BLOCK, num_stages=STAGES):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < V
            s = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) * temp
            key = _key_of(s)
            ok = mask & (key >= lo_key)
            if USE_MASS:
                w = tl.where(ok, tl.exp(s - m), 0.0)
            else:
                w = tl.where(ok, 1.0, 0.0)
            gt = key[:, None] > probes[None, :]
            acc += tl.where(gt, w[:, None], 0.0)
        fails = tl.where((tl.sum(acc, axis=0) >= bound) & (probe_digits < 15), 1, 0)
        digit = tl.sum(fails, axis=0).to(tl.uint32)
        prefix = prefix | (digit << shift)
    return prefix


@triton.jit
def _gather_at_least(base, V, temp, lower, out, CAND: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Copies the raw values v of row ``base`` with ``v * temp >= lower`` to ``out`` (the first CAND
    of them, in order); returns how many there are (may exceed CAND)."""
    n = tl.full((), 0, tl.int32)
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf"))
        keep = ((offs < V) & (x.to(tl.float32) * temp >= lower)).to(tl.int32)
        at = n + tl.cumsum(keep, axis=0) - keep
        tl.store(out + at, x, mask=(keep != 0) & (at < CAND))
        n += tl.sum(keep, axis=0)
    tl.debug_barrier()  # the searches read what other threads wrote
    return n


@triton.jit
def _offset_of(nd_ptr, r, OFF_B: tl.constexpr):
    """``sum(num_drafts[:r])`` (int64): flat index of request r's first draft."""
    acc = tl.zeros([OFF_B], dtype=tl.int64)
    for start in range(0, r, OFF_B):
        i = start + tl.arange(0, OFF_B)
        acc += tl.load(nd_ptr + i, mask=i < r, other=0)
    return tl.sum(acc, axis=0)


@triton.jit
def _chunk_tiles(chunk, TILES, V, BLOCK: tl.constexpr):
    """A chunk's tiles: full tiles [t0, t1) (no mask needed) and, if ``tail``, the masked last tile n_full."""
    t0 = chunk * TILES
    n_full = V // BLOCK
    t1 = tl.minimum(t0 + TILES, n_full)
    tail = (n_full * BLOCK < V) & (n_full >= t0) & (n_full < t0 + TILES)
    return t0, t1, tail, n_full


@triton.jit(do_not_specialize=["ds_s", "temp_s", "topk_s", "topp_s"])
def _filter_kernel(
    logits_ptr, stride_l, nd_ptr, ds_ptr, ds_s, temp_ptr, temp_s, topk_ptr, topk_s, topp_ptr, topp_s,
    thr_ptr, cand_ptr, V,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr, CAND: tl.constexpr,
    OFF_B: tl.constexpr,
):
    req = tl.program_id(0)
    j = tl.program_id(1)
    off = _offset_of(nd_ptr, req, OFF_B)  # issued together with the length load below
    if j <= tl.load(nd_ptr + req):
        row = off + req + j
        _filter_row(logits_ptr, stride_l, row, req, ds_ptr, ds_s, temp_ptr, temp_s, topk_ptr, topk_s,
                    topp_ptr, topp_s, thr_ptr, cand_ptr, V, HAS_K, HAS_P, BLOCK, STAGES, CAND)


@triton.jit
def _filter_row(
    logits_ptr, stride_l, row, req, ds_ptr, ds_s, temp_ptr, temp_s, topk_ptr, topk_s, topp_ptr, topp_s,
    thr_ptr, cand_ptr, V, HAS_K: tl.constexpr, HAS_P: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr, CAND: tl.constexpr,
):
    """The processed-logit threshold of one row (-inf: unfiltered). With a top k of at most BLOCK,
    the row's values above a lower bound of the k-th largest are first gathered into ``cand_ptr``
    (at most CAND of them; more: the searches read the whole row), so that the radix searches
    read those few values instead of the row 17 times."""
    ds = tl.load(ds_ptr + req * ds_s) != 0
    temp = 1.0 / tl.load(temp_ptr + req * temp_s)  # used as a multiplier
    thr = tl.full((), float("-inf"), tl.float32)
    base = logits_ptr + row.to(tl.int64) * stride_l
    k = tl.full((), 0, tl.int64)
    top_p = tl.full((), 1.0, tl.float32)
    if HAS_K:
        k = tl.load(topk_ptr + req * topk_s).to(tl.int64)
    if HAS_P:
        top_p = tl.load(topp_ptr + req * topp_s)
    need_k = ds & (k > 0) & (k < V)
    need_p = ds & (top_p < 1.0)
    if need_k | need_p:
        m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in tl.range(0, V, BLOCK, num_stages=STAGES):
            offs = start + tl.arange(0, BLOCK)
            s = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * temp
            m_vec = tl.maximum(m_vec, s)
        m = tl.max(m_vec, axis=0)
        lo_key = tl.full((), 0, tl.uint32)
        src = base  # the values both searches read: the row, or its candidates for the top k
        n = V
        if need_k:
            # The lanes' maxima are maxima of disjoint subsets, so their k-th largest is at most the
            # row's: every value of the top k (and of top-p within it) is at least that bound.
            if k <= BLOCK:
                lane_max = tl.sort(m_vec, descending=True)
                bound_k = tl.sum(tl.where(tl.arange(0, BLOCK) == k - 1, lane_max, 0.0), axis=0)
                n_cand = _gather_at_least(base, V, temp, bound_k, cand_ptr + row.to(tl.int64) * CAND, CAND,
                                          BLOCK, STAGES)
                if n_cand <= CAND:
                    src = cand_ptr + row.to(tl.int64) * CAND
                    n = n_cand
            lo_key = _radix_search(src, n, temp, lo_key, m, k.to(tl.float32), False, BLOCK, STAGES)
        thr_key = lo_key
        if need_p:
            zk = tl.zeros([BLOCK], dtype=tl.float32)
            for start in tl.range(0, n, BLOCK, num_stages=STAGES):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                s = tl.load(src + offs, mask=mask, other=float("-inf")).to(tl.float32) * temp
                zk += tl.where(mask & (_key_of(s) >= lo_key), tl.exp(s - m), 0.0)
            bound = top_p * tl.sum(zk, axis=0)
            thr_key = _radix_search(src, n, temp, lo_key, m, bound, True, BLOCK, STAGES)
        thr_key = tl.minimum(thr_key, _key_of(m))
        thr = _float_of(thr_key)
    tl.store(thr_ptr + row, thr)


@triton.jit(do_not_specialize=["ds_s", "temp_s", "NCHUNK", "TILES"])
def _stats_kernel(
    logits_ptr, stride_l, nd_ptr, ds_ptr, ds_s, temp_ptr, temp_s, thr_ptr, pm_ptr, pz_ptr, pi_ptr, ticket_ptr,
    V, NCHUNK, TILES,
    HAS_THR: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr, OFF_B: tl.constexpr,
    FAST_EXP: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the race kernel may start; it waits for this grid's end
    req = tl.program_id(0)
    j = tl.program_id(1)
    chunk = tl.program_id(2)
    if (j == 0) & (chunk == 0):
        tl.store(ticket_ptr + req, 0)  # the race kernel's count of finished chunks
    off = _offset_of(nd_ptr, req, OFF_B)  # issued together with the length load below
    if j <= tl.load(nd_ptr + req):
        row = off + req + j
        _stats_row(logits_ptr, stride_l, row, req, chunk, ds_ptr, ds_s, temp_ptr, temp_s, thr_ptr,
                   pm_ptr, pz_ptr, pi_ptr, V, NCHUNK, TILES, HAS_THR, BLOCK, STAGES, FAST_EXP)


@triton.jit
def _exp_neg_abs(d, FAST_EXP: tl.constexpr):
    """``exp(-|d|)``. FAST_EXP (compiled GPU code only): the same ``ex2.approx`` of ``-|d| * log2(e)``
    that ``tl.exp`` emits, in its flush-to-zero form (no subnormal fix-up): identical except that
    results below 2**-126 become 0, which cannot change a running sum that is >= 1."""
    if FAST_EXP:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [tl.abs(d) * -1.4426950408889634],
            dtype=tl.float32, is_pure=True, pack=1,
        )
    else:
        return tl.exp(-tl.abs(d))


@triton.jit
def _stats_tile(x, t, inv_t, thr, m_vec, z_vec, t_vec, SAMPLE: tl.constexpr, HAS_THR: tl.constexpr,
                FAST_EXP: tl.constexpr):
    """One tile. SAMPLE: per-lane online softmax (running max, sum-exp). Otherwise (greedy rows,
    temperature 1, never filtered): running max and the tile ``t_vec`` of each lane's first max."""
    if SAMPLE:
        s = x.to(tl.float32) * inv_t
        if HAS_THR:
            s = tl.where(s >= thr, s, float("-inf"))
        d = s - m_vec
        e = _exp_neg_abs(d, FAST_EXP)
        up = d > 0
        z_vec = tl.where(up, z_vec * e + 1.0, z_vec + e)
        m_vec = tl.where(up, s, m_vec)
    else:
        s = x.to(tl.float32)
        up = s > m_vec
        t_vec = tl.where(up, t, t_vec)
        m_vec = tl.where(up, s, m_vec)
    return m_vec, z_vec, t_vec


@triton.jit
def _stats_span(base, t0, t1, tail, n_full, V, inv_t, thr, SAMPLE: tl.constexpr, HAS_THR: tl.constexpr,
                BLOCK: tl.constexpr, STAGES: tl.constexpr, FAST_EXP: tl.constexpr):
    """Full tiles [t0, t1) without masks, then the masked tail tile n_full if ``tail``."""
    lane = tl.arange(0, BLOCK)
    # running per-lane max starts at a finite floor so that no -inf - -inf appears
    m_vec = tl.full([BLOCK], -1.0e30, tl.float32)
    z_vec = tl.zeros([BLOCK], dtype=tl.float32)
    t_vec = tl.full([BLOCK], -1, tl.int32)
    if STAGES > 1:
        for t in tl.range(t0, t1, num_stages=STAGES):
            x = tl.load(base + t * BLOCK + lane)
            m_vec, z_vec, t_vec = _stats_tile(x, t, inv_t, thr, m_vec, z_vec, t_vec, SAMPLE, HAS_THR, FAST_EXP)
    else:
        for t in range(t0, t1):
            x = tl.load(base + t * BLOCK + lane)
            m_vec, z_vec, t_vec = _stats_tile(x, t, inv_t, thr, m_vec, z_vec, t_vec, SAMPLE, HAS_THR, FAST_EXP)
    if tail:
        offs = n_full * BLOCK + lane
        x = tl.load(base + offs, mask=offs < V, other=float("-inf"))
        m_vec, z_vec, t_vec = _stats_tile(x, n_full, inv_t, thr, m_vec, z_vec, t_vec, SAMPLE, HAS_THR, FAST_EXP)
    return m_vec, z_vec, t_vec


@triton.jit
def _stats_row(
    logits_ptr, stride_l, row, req, chunk, ds_ptr, ds_s, temp_ptr, temp_s, thr_ptr, pm_ptr, pz_ptr, pi_ptr,
    V, NCHUNK, TILES, HAS_THR: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
    FAST_EXP: tl.constexpr,
):
    """Chunk statistics of one row: max m, sum exp(s - m) (sampling rows; 1 for greedy rows) and
    the first argmax (greedy rows; 0 for sampling rows, where it is never read)."""
    ds = tl.load(ds_ptr + req * ds_s) != 0
    base = logits_ptr + row.to(tl.int64) * stride_l
    # this chunk's tiles: [t0, t0 + TILES) ∩ [0, cdiv(V, BLOCK)); full tiles need no mask
    t0, t1, tail, n_full = _chunk_tiles(chunk, TILES, V, BLOCK)
    out = row * NCHUNK + chunk
    if ds:
        inv_t = 1.0 / tl.load(temp_ptr + req * temp_s)
        thr = float("-inf")
        if HAS_THR:
            thr = tl.load(thr_ptr + row)
        m_vec, z_vec, t_vec = _stats_span(base, t0, t1, tail, n_full, V, inv_t, thr, True, HAS_THR, BLOCK,
                                          STAGES, FAST_EXP)
        m = tl.max(m_vec, axis=0)
        tl.store(pm_ptr + out, m)
        tl.store(pz_ptr + out, tl.sum(z_vec * tl.exp(m_vec - m), axis=0))
        tl.store(pi_ptr + out, 0)
    else:
        m_vec, z_vec, t_vec = _stats_span(base, t0, t1, tail, n_full, V, 1.0, float("-inf"), False, False,
                                          BLOCK, STAGES, FAST_EXP)
        m = tl.max(m_vec, axis=0)
        i_vec = tl.where(t_vec >= 0, t_vec * BLOCK + tl.arange(0, BLOCK), 0)
        tl.store(pm_ptr + out, m)
        tl.store(pz_ptr + out, 1.0)
        tl.store(pi_ptr + out, tl.min(tl.where(m_vec == m, i_vec, 2147483647), axis=0))


@triton.jit
def _accept_request(
    r, logits_ptr, stride_l, q_ptr, stride_q, draft_ptr, nd_ptr, ds, temp, thr_ptr, pm_ptr, pz_ptr, pi_ptr,
    key1, unif_ptr, out_ptr, stride_o, nacc_ptr, NCHUNK, OUT_W, write,
    HAS_Q: tl.constexpr, HAS_THR: tl.constexpr, EXPLICIT_U: tl.constexpr,
    NCHUNK_P2: tl.constexpr, L_P2: tl.constexpr, OFF_B: tl.constexpr, PDL: tl.constexpr,
):
    """Acceptance of request r: merges the chunk statistics of its l + 1 rows at once (an
    ``[L_P2, NCHUNK_P2]`` block), runs every acceptance test in parallel and takes the first
    rejection n (l when all are accepted). ``write``: store n, the accepted drafts and the greedy
    token. Returns (n, l, the request's flat draft offset, max and sum-exp of the emit row n).
    PDL: everything that is not the stats kernel's output is loaded before waiting for it."""
    l = tl.load(nd_ptr + r)
    off = _offset_of(nd_ptr, r, OFF_B)
    jj = tl.arange(0, L_P2)  # row j of the request = draft position j (j == l: bonus row)
    rv = jj <= l
    dv = jj < l
    rows = off + r + jj
    d = tl.load(draft_ptr + off + jj, mask=dv, other=0)
    s_d = tl.load(logits_ptr + rows * stride_l + d, mask=dv, other=float("-inf")).to(tl.float32) * temp
    thr = float("-inf")
    if HAS_THR:  # the filter kernel ran before the stats kernel started
        thr = tl.load(thr_ptr + rows, mask=dv, other=float("-inf"))
    if HAS_Q:
        q_d = tl.load(q_ptr + (off + jj) * stride_q + d, mask=dv, other=1.0).to(tl.float32)
    else:
        q_d = 1.0
    if EXPLICIT_U:
        u = tl.load(unif_ptr + off + jj, mask=dv, other=0.0)
    else:
        u = _uniform(key1, jj)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the stats kernel has finished and its writes are visible

    c = tl.arange(0, NCHUNK_P2)
    ci = rows[:, None] * NCHUNK + c[None, :]
    cmask = rv[:, None] & (c < NCHUNK)[None, :]
    pm = tl.load(pm_ptr + ci, mask=cmask, other=float("-inf"))
    pz = tl.load(pz_ptr + ci, mask=cmask, other=0.0)
    pi = tl.load(pi_ptr + ci, mask=cmask, other=2147483647)
    m = tl.where(rv, tl.max(pm, axis=1), 0.0)  # rows past l: finite placeholders, never used
    z = tl.sum(pz * tl.exp(pm - m[:, None]), axis=1)
    z = tl.where(rv, z, 1.0)
    amax = tl.min(tl.where(pm == m[:, None], pi, 2147483647), axis=1)
    p_d = tl.where(s_d >= thr, tl.exp(s_d - m) / z, 0.0)
    acc = tl.where(ds, u * q_d < p_d, d == amax)
    n = tl.min(tl.where(acc | (jj >= l), l, jj), axis=0).to(tl.int64)

    sel = jj == n
    m_e = tl.max(tl.where(sel, m, float("-inf")), axis=0)
    z_e = tl.max(tl.where(sel, z, float("-inf")), axis=0)
    if write:
        amax_e = tl.min(tl.where(sel, amax, 2147483647), axis=0)
        tl.store(nacc_ptr + r, n)
        emit = tl.where(ds, -1, amax_e.to(tl.int64))  # sampling: written by the request's last race program
        tok = tl.where(jj < n, d, tl.where(jj == n, emit, -1))
        tl.store(out_ptr + r * stride_o + jj, tok, mask=jj < OUT_W)
    return n, l, off, m_e, z_e


@triton.jit(do_not_specialize=["ds_s", "temp_s", "seed_s", "off_s", "stride_o", "NCHUNK_S", "NCHUNK", "TILES",
                               "OUT_W"])
def _accept_race_kernel(
    logits_ptr, stride_l, q_ptr, stride_q, draft_ptr, nd_ptr, ds_ptr, ds_s, temp_ptr, temp_s, thr_ptr,
    pm_ptr, pz_ptr, pi_ptr, seed_ptr, seed_s, off_ptr, off_s, unif_ptr, exp_ptr, stride_e,
    out_ptr, stride_o, nacc_ptr, ticket_ptr, rv_ptr, ri_ptr, pv_ptr, pvi_ptr, V, NCHUNK_S, NCHUNK, TILES, OUT_W,
    HAS_Q: tl.constexpr, HAS_THR: tl.constexpr, EXPLICIT_U: tl.constexpr, EXPLICIT_E: tl.constexpr,
    SAMPLE: tl.constexpr, NCHUNK_P2: tl.constexpr, L_P2: tl.constexpr, NCHUNK_R_P2: tl.constexpr,
    OFF_B: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (requests, race chunks). Every program of a sampling request evaluates the request's
    acceptance (a few loads; chunk 0 writes it), then races its chunk of the emit row (see
    ``_race_chunk``); the request's last program to finish draws the token. PDL: launched as a
    programmatic dependent of the stats kernel; waits for it before reading anything it wrote."""
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    ds = tl.load(ds_ptr + r * ds_s) != 0
    if ds | (chunk == 0):
        temp = 1.0 / tl.where(ds, tl.load(temp_ptr + r * temp_s), 1.0)  # multiplier
        seed = tl.load(seed_ptr + r * seed_s)
        offset = tl.load(off_ptr + r * off_s)
        n, l, off, m, z = _accept_request(
            r, logits_ptr, stride_l, q_ptr, stride_q, draft_ptr, nd_ptr, ds, temp, thr_ptr, pm_ptr, pz_ptr,
            pi_ptr, _stream_key(seed, offset, 1), unif_ptr, out_ptr, stride_o, nacc_ptr, NCHUNK_S, OUT_W,
            chunk == 0, HAS_Q, HAS_THR, EXPLICIT_U, NCHUNK_P2, L_P2, OFF_B, PDL)
        if SAMPLE:
            if ds:
                e = off + r + n
                has_q = n < l
                qrow = tl.where(has_q, off + n, 0)  # the emit position's draft row
                _race_chunk(logits_ptr + e.to(tl.int64) * stride_l, q_ptr + qrow.to(tl.int64) * stride_q,
                            tl.load(draft_ptr + qrow, mask=has_q, other=-1), tl.where(has_q, V, 0), temp, m,
                            1.0 / z, thr_ptr + e, exp_ptr + r.to(tl.int64) * stride_e, seed, offset, chunk,
                            r * NCHUNK, ticket_ptr + r, rv_ptr, ri_ptr, pv_ptr, pvi_ptr,
                            out_ptr + r * stride_o + n, V, NCHUNK, TILES, HAS_Q, HAS_THR, EXPLICIT_E, NCHUNK_R_P2,
                            BLOCK, STAGES)


@triton.jit
def _race_chunk(
    base, qbase, d, q_len, temp, m, inv_z, thr_ptr, ebase, seed, offset, chunk, o0, ticket_ptr, rv_ptr, ri_ptr,
    pv_ptr, pvi_ptr, tok_ptr, V, NCHUNK, TILES, HAS_Q: tl.constexpr, HAS_THR: tl.constexpr,
    EXPLICIT_E: tl.constexpr, NCHUNK_P2: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    """One chunk of the emit row's race, then, in the request's last program, the token.

    Counter noise: each group of BLOCK = ``rng.RACE_GROUP`` ids enters its residual mass over its
    Exp(1) noise (one sum and one noise value per group); the last program takes the best group
    and races its ids (or, with no residual mass anywhere, every id of p). Explicit noise: every
    id races; the last program merges the chunks. The ticket counter was zeroed by the stats kernel.
    (Racing each chunk's best group in its own program instead, so that the last program only
    compares, was slower on the H200: 23.6 against 21.0 us at batch 64, l 4.)"""
    t0, t1, tail, n_full = _chunk_tiles(chunk, TILES, V, BLOCK)
    o = o0 + chunk
    if EXPLICIT_E:
        _flat_race_span(base, qbase, d, q_len, temp, m, inv_z, ebase, thr_ptr, t0, t1, tail, n_full, V, rv_ptr + o,
                        ri_ptr + o, pv_ptr + o, pvi_ptr + o, HAS_Q, HAS_THR, BLOCK)
    else:
        gkey = _stream_key(seed, offset, rng.STREAM_GROUP)
        best, best_g = _group_race_span(base, qbase, d, q_len, temp, m, inv_z, gkey, thr_ptr, t0, t1, tail, n_full,
                                        V, HAS_Q, HAS_THR, BLOCK, STAGES)
        tl.store(rv_ptr + o, best)
        tl.store(ri_ptr + o, best_g)
    tl.debug_barrier()  # every thread's stores precede the release below
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == NCHUNK - 1:  # the request's last program
        c = tl.arange(0, NCHUNK_P2)
        cm = c < NCHUNK
        vr, ir = _first_max(tl.load(rv_ptr + o0 + c, mask=cm, other=-1.0, volatile=True),
                            tl.load(ri_ptr + o0 + c, mask=cm, other=2147483647, volatile=True))
        if EXPLICIT_E:
            vp, ip = _first_max(tl.load(pv_ptr + o0 + c, mask=cm, other=-1.0, volatile=True),
                                tl.load(pvi_ptr + o0 + c, mask=cm, other=2147483647, volatile=True))
            tok = tl.where(vr > 0, ir, ip)
        else:
            key = _stream_key(seed, offset, rng.STREAM_RESIDUAL)
            if vr > 0:
                tok = _emit_from_group(base, qbase, d, q_len, temp, m, inv_z, thr_ptr, key, ir, V, HAS_Q, HAS_THR,
                                       BLOCK)
            else:
                tok = _emit_from_p(base, temp, m, inv_z, thr_ptr, key, V, HAS_THR, BLOCK)
        tl.store(tok_ptr, tok.to(tl.int64))


@triton.jit
def _residual_tile(base, qbase, d, q_len, temp, m, inv_z, thr_ptr, offs, V, HAS_Q: tl.constexpr,
                   HAS_THR: tl.constexpr, MASKED: tl.constexpr):
    """p and the residual max(p - q, 0) of one tile of the emit row (0 outside the vocab). q: the
    row at ``qbase`` (HAS_Q; its first ``q_len`` entries: V, or 0 for the bonus row, which has no
    draft) or one-hot at d (d = -1 for the bonus row)."""
    if MASKED:
        s = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * temp
    else:
        s = tl.load(base + offs).to(tl.float32) * temp
    p = tl.exp(s - m) * inv_z  # masked lanes: exp(-inf) = 0
    if HAS_THR:
        p = tl.where(s >= tl.load(thr_ptr), p, 0.0)
    if HAS_Q:
        q = tl.load(qbase + offs, mask=offs < q_len, other=0.0).to(tl.float32)
    else:
        q = tl.where(offs == d, 1.0, 0.0)
    return p, tl.maximum(p - q, 0.0)


@triton.jit
def _group_key(base, qbase, d, q_len, temp, m, inv_z, gkey, thr_ptr, offs, g, V, best, best_g,
               HAS_Q: tl.constexpr, HAS_THR: tl.constexpr, MASKED: tl.constexpr):
    """Race key of group g: its residual mass over its Exp(1) noise; keeps the larger (first on ties)."""
    _, res = _residual_tile(base, qbase, d, q_len, temp, m, inv_z, thr_ptr, offs, V, HAS_Q, HAS_THR, MASKED)
    key = tl.sum(res, axis=0) / _exp1(_uniform(gkey, g + tl.zeros((), tl.int32)))  # g: a loop index
    up = key > best
    return tl.where(up, key, best), tl.where(up, g, best_g)


@triton.jit
def _group_race_span(base, qbase, d, q_len, temp, m, inv_z, gkey, thr_ptr, t0, t1, tail, n_full, V,
                     HAS_Q: tl.constexpr, HAS_THR: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Best group key in groups [t0, t1) (unmasked) and the masked tail group n_full if ``tail``;
    (0, -1) when none of them has residual mass."""
    lane = tl.arange(0, BLOCK)
    best = tl.full((), 0.0, tl.float32)
    best_g = tl.full((), -1, tl.int32)
    if STAGES > 1:
        for g in tl.range(t0, t1, num_stages=STAGES):
            best, best_g = _group_key(base, qbase, d, q_len, temp, m, inv_z, gkey, thr_ptr, g * BLOCK + lane, g, V,
                                      best, best_g, HAS_Q, HAS_THR, False)
    else:
        for g in range(t0, t1):
            best, best_g = _group_key(base, qbase, d, q_len, temp, m, inv_z, gkey, thr_ptr, g * BLOCK + lane, g, V,
                                      best, best_g, HAS_Q, HAS_THR, False)
    if tail:
        best, best_g = _group_key(base, qbase, d, q_len, temp, m, inv_z, gkey, thr_ptr, n_full * BLOCK + lane, n_full,
                                  V, best, best_g, HAS_Q, HAS_THR, True)
    return best, best_g


@triton.jit
def _id_race(w, inv_e, offs, best, best_i):
    """Keeps each lane's larger key w / E (the first id on ties)."""
    key = w * inv_e
    up = key > best
    return tl.where(up, key, best), tl.where(up, offs, best_i)


@triton.jit
def _first_max(best, best_i):
    v = tl.max(best, axis=0)
    return v, tl.min(tl.where(best == v, best_i, 2147483647), axis=0)


@triton.jit
def _flat_race_span(base, qbase, d, q_len, temp, m, inv_z, ebase, thr_ptr, t0, t1, tail, n_full, V,
                    rv_ptr, ri_ptr, pv_ptr, pvi_ptr, HAS_Q: tl.constexpr, HAS_THR: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Explicit noise E (tests): both races ``max(p - q, 0) / E`` and ``p / E`` over every id of tiles
    [t0, t1) and the tail; stores each race's best key and first id."""
    lane = tl.arange(0, BLOCK)
    br = tl.full([BLOCK], -1.0, tl.float32)
    bri = tl.full([BLOCK], 2147483647, tl.int32)
    bp = tl.full([BLOCK], -1.0, tl.float32)
    bpi = tl.full([BLOCK], 2147483647, tl.int32)
    t_end = tl.where(tail, n_full + 1, t1)
    for t in range(t0, t_end):
        offs = t * BLOCK + lane
        p, res = _residual_tile(base, qbase, d, q_len, temp, m, inv_z, thr_ptr, offs, V, HAS_Q, HAS_THR, True)
        inv_e = 1.0 / tl.load(ebase + offs, mask=offs < V, other=1.0)
        br, bri = _id_race(tl.where(offs < V, res, -1.0), inv_e, offs, br, bri)
        bp, bpi = _id_race(tl.where(offs < V, p, -1.0), inv_e, offs, bp, bpi)
    vr, ir = _first_max(br, bri)
    vp, ip = _first_max(bp, bpi)
    tl.store(rv_ptr, vr)
    tl.store(ri_ptr, ir)
    tl.store(pv_ptr, vp)
    tl.store(pvi_ptr, ip)


@triton.jit
def _emit_from_group(base, qbase, d, q_len, temp, m, inv_z, thr_ptr, key, g, V, HAS_Q: tl.constexpr,
                     HAS_THR: tl.constexpr, BLOCK: tl.constexpr):
    """The id race ``max(p - q, 0) / E_v`` inside group g (noise: the id's own counter)."""
    offs = g * BLOCK + tl.arange(0, BLOCK)
    _, res = _residual_tile(base, qbase, d, q_len, temp, m, inv_z, thr_ptr, offs, V, HAS_Q, HAS_THR, True)
    inv_e = 1.0 / _exp1(_uniform(key, offs))
    best, best_i = _id_race(tl.where(offs < V, res, -1.0), inv_e, offs, tl.full([BLOCK], -1.0, tl.float32),
                            tl.full([BLOCK], 2147483647, tl.int32))
    return _first_max(best, best_i)[1]


@triton.jit
def _emit_from_p(base, temp, m, inv_z, thr_ptr, key, V, HAS_THR: tl.constexpr, BLOCK: tl.constexpr):
    """The id race ``p / E_v`` over the whole row: the fallback when the residual has no mass."""
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + lane
        p, _ = _residual_tile(base, base, -1, 0, temp, m, inv_z, thr_ptr, offs, V, False, HAS_THR, True)
        best, best_i = _id_race(tl.where(offs < V, p, -1.0), 1.0 / _exp1(_uniform(key, offs)), offs, best, best_i)
    return _first_max(best, best_i)[1]


def _chunking(n_programs_rows: int, V: int, block: int, target: int) -> tuple[int, int]:
    """(chunks, tiles per chunk) so that rows * chunks is about ``target`` programs."""
    n_tiles = triton.cdiv(V, block)
    want = max(1, min(n_tiles, triton.cdiv(target, max(n_programs_rows, 1))))
    tiles = triton.cdiv(n_tiles, want)
    return triton.cdiv(n_tiles, tiles), tiles


def _bucket(n: int, least: int = 8) -> int:
    """Constexpr width for n items: a power of two, at least ``least`` (fewer variants)."""
    return max(least, triton.next_power_of_2(n))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_SM_COUNT: dict = {}


def _supports_dependent_launch(dev: torch.device) -> bool:
    """Programmatic dependent launch: compiled CUDA code on compute capability 9.0 or later."""
    return dev.type == "cuda" and not _interpreting() and torch.cuda.get_device_capability(dev)[0] >= 9


def _sm_count(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 1
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def verify_triton(p, config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backend. ``p`` is an ``api._Prepared``; returns (num_accepted, output_tokens).

    ``config``: launch shape of the stats / race kernels (default: :func:`get_launch_config`)."""
    cfg = config if config is not None else _CONFIG
    logits = p.target_logits
    dev = logits.device
    N, V = logits.shape
    R, L = p.num_drafts.shape[0], p.max_draft_len
    out = torch.empty((R, L + 1), dtype=torch.int64, device=dev)
    nacc = torch.empty((R,), dtype=torch.int64, device=dev)
    if R == 0:
        return nacc, out
    v_p2 = triton.next_power_of_2(V)
    sms = _sm_count(dev)
    nd = p.num_drafts
    ds, temp = p.do_sample, p.temperature
    pr_args = (ds, ds.stride(0), temp, temp.stride(0))
    has_thr = p.top_k is not None or p.top_p is not None
    thr = torch.empty((N,), dtype=torch.float32, device=dev)
    if has_thr:
        tk = p.top_k if p.top_k is not None else nd
        tp = p.top_p if p.top_p is not None else thr
        cand = torch.empty((N if p.top_k is not None else 1, FILTER_CANDIDATES), dtype=logits.dtype, device=dev)
        _filter_kernel[(R, L + 1)](
            logits, logits.stride(0), nd, *pr_args, tk, tk.stride(0), tp, tp.stride(0), thr, cand, V,
            HAS_K=p.top_k is not None, HAS_P=p.top_p is not None, BLOCK=min(cfg.filter_block, v_p2),
            STAGES=cfg.filter_stages, CAND=FILTER_CANDIDATES, OFF_B=OFF_BLOCK, num_warps=cfg.filter_warps,
        )
    sblock = min(cfg.stats_block, v_p2)
    nchunk, tiles = _chunking(N, V, sblock, cfg.stats_programs_per_sm * sms)
    pm = torch.empty((N, nchunk), dtype=torch.float32, device=dev)
    pz = torch.empty_like(pm)
    pi = torch.empty((N, nchunk), dtype=torch.int32, device=dev)
    ticket = torch.empty((R,), dtype=torch.int32, device=dev)
    pdl = cfg.dependent_launch and _supports_dependent_launch(dev)
    _stats_kernel[(R, L + 1, nchunk)](
        logits, logits.stride(0), nd, *pr_args, thr, pm, pz, pi, ticket, V, nchunk, tiles,
        HAS_THR=has_thr, BLOCK=sblock, STAGES=cfg.stats_stages, OFF_B=OFF_BLOCK, FAST_EXP=not _interpreting(),
        PDL=pdl, num_warps=cfg.stats_warps,
    )
    q = p.draft_probs
    has_q = q is not None
    # race groups: rng.RACE_GROUP ids (one group when the vocabulary is smaller)
    gblock = min(rng.RACE_GROUP, v_p2)
    nchunk_r, tiles_r = _chunking(R, V, gblock, cfg.race_programs_per_sm * sms) if p.any_sample else (1, 1)
    rc = (R * nchunk_r + 3) // 4 * 4  # rows padded to 16 bytes: alignment (a specialisation) independent of R
    rv = torch.empty((2, rc), dtype=torch.float32, device=dev)  # per chunk: best race keys
    ri = torch.empty((2, rc), dtype=torch.int32, device=dev)  # their group / id
    ex = p.exponentials
    _accept_race_kernel[(R, nchunk_r)](
        logits, logits.stride(0), q if has_q else thr, q.stride(0) if has_q else 0,
        p.draft_ids if p.draft_ids.numel() > 0 else nacc,  # never read when T == 0
        nd, *pr_args, thr, pm, pz, pi, p.seeds, p.seeds.stride(0), p.offsets, p.offsets.stride(0),
        p.uniforms if p.uniforms is not None else thr, ex if ex is not None else thr,
        ex.stride(0) if ex is not None else 0, out, out.stride(0), nacc, ticket, rv[0], ri[0], rv[1], ri[1],
        V, nchunk, nchunk_r, tiles_r, L + 1,
        HAS_Q=has_q, HAS_THR=has_thr, EXPLICIT_U=p.uniforms is not None, EXPLICIT_E=ex is not None,
        SAMPLE=p.any_sample, NCHUNK_P2=_bucket(nchunk), L_P2=_bucket(L + 1), NCHUNK_R_P2=_bucket(nchunk_r, 32),
        OFF_B=OFF_BLOCK, BLOCK=gblock, STAGES=cfg.race_stages, PDL=pdl, num_warps=cfg.race_warps, launch_pdl=pdl,
    )
    return nacc, out
