"""Triton backend of :func:`dspark_hf.verify.verify`.

Launches (all asynchronous, no host synchronisation):

1. ``_filter_kernel`` (only when top_k / top_p is given), one program per target row: an
   exact 16-way radix search over order-preserving float32 keys finds the top-k value and
   then the top-p threshold (8 passes each; rows without an active filter exit at once).
2. ``_stats_kernel``, grid (rows, vocab chunks): online softmax statistics of the processed
   logits per chunk (per-lane running max / sum-exp / first argmax, one exp per element).
3. ``_accept_kernel``, one program per request: merges the chunk statistics, walks the drafts
   (acceptance test with counter-based uniforms), writes accepted drafts + padding, and the
   greedy emitted token.
4. ``_race_kernel``, grid (requests, vocab chunks): at the emit row only, the exponential race
   ``argmax max(p - q, 0) / E`` and ``argmax p / E`` with E drawn in-kernel (never stored).
5. ``_finalize_kernel``, one program per request: merges the race partials, writes the token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import rng


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
def _radix_search(base, V, temp, lo_key, m, bound, USE_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Smallest uint32 key K with  sum_{v: key_v > K, key_v >= lo_key} w_v  <  bound,
    w_v = exp(s_v - m) (USE_MASS) or 1."""
    probe_digits = tl.arange(0, 16).to(tl.uint32)
    prefix = tl.full((), 0, tl.uint32)
    for rnd in tl.static_range(8):
        shift = 28 - 4 * rnd
        low = tl.full((), (1 << shift) - 1, tl.uint32)
        probes = prefix | (probe_digits << shift) | low
        acc = tl.zeros([16], dtype=tl.float32)
        for start in range(0, V, BLOCK):
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
            acc += tl.sum(tl.where(gt, w[:, None], 0.0), axis=0)
        fails = tl.where((acc >= bound) & (probe_digits < 15), 1, 0)
        digit = tl.sum(fails, axis=0).to(tl.uint32)
        prefix = prefix | (digit << shift)
    return prefix


@triton.jit
def _filter_kernel(
    logits_ptr, stride_l, nd_ptr, cu_ptr, ds_ptr, ds_s, temp_ptr, temp_s, topk_ptr, topk_s, topp_ptr, topp_s,
    thr_ptr, V,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    j = tl.program_id(1)
    if j <= tl.load(nd_ptr + req):
        row = tl.load(cu_ptr + req) + req + j
        _filter_row(logits_ptr, stride_l, row, req, ds_ptr, ds_s, temp_ptr, temp_s, topk_ptr, topk_s,
                    topp_ptr, topp_s, thr_ptr, V, HAS_K, HAS_P, BLOCK)


@triton.jit
def _filter_row(
    logits_ptr, stride_l, row, req, ds_ptr, ds_s, temp_ptr, temp_s, topk_ptr, topk_s, topp_ptr, topp_s,
    thr_ptr, V, HAS_K: tl.constexpr, HAS_P: tl.constexpr, BLOCK: tl.constexpr,
):
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
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            s = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * temp
            m_vec = tl.maximum(m_vec, s)
        m = tl.max(m_vec, axis=0)
        lo_key = tl.full((), 0, tl.uint32)
        if need_k:
            lo_key = _radix_search(base, V, temp, lo_key, m, k.to(tl.float32), False, BLOCK)
        thr_key = lo_key
        if need_p:
            zk = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < V
                s = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) * temp
                zk += tl.where(mask & (_key_of(s) >= lo_key), tl.exp(s - m), 0.0)
            bound = top_p * tl.sum(zk, axis=0)
            thr_key = _radix_search(base, V, temp, lo_key, m, bound, True, BLOCK)
        thr_key = tl.minimum(thr_key, _key_of(m))
        thr = _float_of(thr_key)
    tl.store(thr_ptr + row, thr)


@triton.jit
def _stats_kernel(
    logits_ptr, stride_l, nd_ptr, cu_ptr, ds_ptr, ds_s, temp_ptr, temp_s, thr_ptr, pm_ptr, pz_ptr, pi_ptr,
    V, NCHUNK, TILES,
    HAS_THR: tl.constexpr, BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    j = tl.program_id(1)
    chunk = tl.program_id(2)
    if j <= tl.load(nd_ptr + req):
        row = tl.load(cu_ptr + req) + req + j
        _stats_row(logits_ptr, stride_l, row, req, chunk, ds_ptr, ds_s, temp_ptr, temp_s, thr_ptr,
                   pm_ptr, pz_ptr, pi_ptr, V, NCHUNK, TILES, HAS_THR, BLOCK)


@triton.jit
def _stats_row(
    logits_ptr, stride_l, row, req, chunk, ds_ptr, ds_s, temp_ptr, temp_s, thr_ptr, pm_ptr, pz_ptr, pi_ptr,
    V, NCHUNK, TILES, HAS_THR: tl.constexpr, BLOCK: tl.constexpr,
):
    ds = tl.load(ds_ptr + req * ds_s) != 0
    inv_t = 1.0 / tl.where(ds, tl.load(temp_ptr + req * temp_s), 1.0)
    thr = float("-inf")
    if HAS_THR:
        thr = tl.load(thr_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_l
    # running per-lane max starts at a finite floor so that no -inf - -inf appears
    m_vec = tl.full([BLOCK], -1.0e30, tl.float32)
    z_vec = tl.zeros([BLOCK], dtype=tl.float32)
    i_vec = tl.zeros([BLOCK], dtype=tl.int32)
    start0 = chunk * TILES * BLOCK
    for t in range(0, TILES):
        offs = start0 + t * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        s = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        if HAS_THR:
            s = tl.where(s >= thr, s, float("-inf"))
        d = s - m_vec
        e = tl.exp(-tl.abs(d))
        up = d > 0
        z_vec = tl.where(up, z_vec * e + 1.0, z_vec + e)
        i_vec = tl.where(up, offs, i_vec)
        m_vec = tl.where(up, s, m_vec)
    m = tl.max(m_vec, axis=0)
    z = tl.sum(z_vec * tl.exp(m_vec - m), axis=0)
    idx = tl.min(tl.where(m_vec == m, i_vec, 2147483647), axis=0)
    out = row * NCHUNK + chunk
    tl.store(pm_ptr + out, m)
    tl.store(pz_ptr + out, z)
    tl.store(pi_ptr + out, idx)


@triton.jit
def _merge_stats(pm_ptr, pz_ptr, pi_ptr, row, NCHUNK, NCHUNK_P2: tl.constexpr):
    c = tl.arange(0, NCHUNK_P2)
    cm = c < NCHUNK
    pm = tl.load(pm_ptr + row * NCHUNK + c, mask=cm, other=float("-inf"))
    pz = tl.load(pz_ptr + row * NCHUNK + c, mask=cm, other=0.0)
    pi = tl.load(pi_ptr + row * NCHUNK + c, mask=cm, other=2147483647)
    m = tl.max(pm, axis=0)
    z = tl.sum(pz * tl.exp(pm - m), axis=0)
    idx = tl.min(tl.where(pm == m, pi, 2147483647), axis=0)
    return m, z, idx


@triton.jit
def _accept_kernel(
    logits_ptr, stride_l, q_ptr, stride_q, draft_ptr, nd_ptr, cu_ptr, ds_ptr, ds_s, temp_ptr, temp_s,
    thr_ptr, pm_ptr, pz_ptr, pi_ptr, seed_ptr, seed_s, off_ptr, off_s, key2_ptr, unif_ptr,
    out_ptr, stride_o, nacc_ptr, em_ptr, ez_ptr, NCHUNK, OUT_W,
    HAS_Q: tl.constexpr, HAS_THR: tl.constexpr, EXPLICIT_U: tl.constexpr,
    NCHUNK_P2: tl.constexpr, OUT_P2: tl.constexpr,
):
    r = tl.program_id(0)
    l = tl.load(nd_ptr + r)
    off = tl.load(cu_ptr + r)
    row0 = off + r
    ds = tl.load(ds_ptr + r * ds_s) != 0
    temp = 1.0 / tl.where(ds, tl.load(temp_ptr + r * temp_s), 1.0)  # multiplier
    seed = tl.load(seed_ptr + r * seed_s)
    offset = tl.load(off_ptr + r * off_s)
    key1 = _stream_key(seed, offset, 1)
    tl.store(key2_ptr + r, _stream_key(seed, offset, 2).to(tl.int64))
    n = off * 0
    alive = ds | True
    for j in range(0, l):
        row = row0 + j
        m, z, amax = _merge_stats(pm_ptr, pz_ptr, pi_ptr, row, NCHUNK, NCHUNK_P2)
        d = tl.load(draft_ptr + off + j)
        s_d = tl.load(logits_ptr + row * stride_l + d).to(tl.float32) * temp
        thr = float("-inf")
        if HAS_THR:
            thr = tl.load(thr_ptr + row)
        p_d = tl.where(s_d >= thr, tl.exp(s_d - m) / z, 0.0)
        if HAS_Q:
            q_d = tl.load(q_ptr + (off + j) * stride_q + d).to(tl.float32)
        else:
            q_d = 1.0
        if EXPLICIT_U:
            u = tl.load(unif_ptr + off + j)
        else:
            u = _uniform(key1, off * 0 + j)
        acc = tl.where(ds, u * q_d < p_d, d == amax)
        alive = alive & acc
        n += alive.to(tl.int64)
    e = row0 + n
    m_e, z_e, amax_e = _merge_stats(pm_ptr, pz_ptr, pi_ptr, e, NCHUNK, NCHUNK_P2)
    tl.store(nacc_ptr + r, n)
    tl.store(em_ptr + r, m_e)
    tl.store(ez_ptr + r, z_e)
    pos = tl.arange(0, OUT_P2)
    dv = tl.load(draft_ptr + off + pos, mask=pos < l, other=-1)
    emit = tl.where(ds, -1, amax_e.to(tl.int64))
    tok = tl.where(pos < n, dv, tl.where(pos == n, emit, -1))
    tl.store(out_ptr + r * stride_o + pos, tok, mask=pos < OUT_W)


@triton.jit
def _race_kernel(
    logits_ptr, stride_l, q_ptr, stride_q, draft_ptr, nd_ptr, cu_ptr, ds_ptr, ds_s, temp_ptr, temp_s,
    thr_ptr, nacc_ptr, em_ptr, ez_ptr, key_ptr, exp_ptr, stride_e,
    pr_ptr, pri_ptr, pp_ptr, ppi_ptr, V, NCHUNK, TILES,
    HAS_Q: tl.constexpr, HAS_THR: tl.constexpr, EXPLICIT_E: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    ds = tl.load(ds_ptr + r * ds_s) != 0
    if ds:
        n = tl.load(nacc_ptr + r)
        l = tl.load(nd_ptr + r)
        off = tl.load(cu_ptr + r)
        e = off + r + n
        has_q = n < l
        qrow = off + n
        m = tl.load(em_ptr + r)
        inv_z = 1.0 / tl.load(ez_ptr + r)
        temp = 1.0 / tl.load(temp_ptr + r * temp_s)  # multiplier
        thr = float("-inf")
        if HAS_THR:
            thr = tl.load(thr_ptr + e)
        qrow = tl.where(has_q, qrow, 0)
        qlim = tl.where(has_q, V, 0)
        d = tl.where(has_q, tl.load(draft_ptr + qrow), -1)
        key = tl.load(key_ptr + r).to(tl.uint32)
        base = logits_ptr + e.to(tl.int64) * stride_l
        qbase = q_ptr + qrow.to(tl.int64) * stride_q
        br = tl.full([BLOCK], -1.0, tl.float32)
        bri = tl.zeros([BLOCK], dtype=tl.int32)
        bp = tl.full([BLOCK], -1.0, tl.float32)
        bpi = tl.zeros([BLOCK], dtype=tl.int32)
        start0 = chunk * TILES * BLOCK
        for t in range(0, TILES):
            offs = start0 + t * BLOCK + tl.arange(0, BLOCK)
            mask = offs < V
            s = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) * temp
            p = tl.where(mask & (s >= thr), tl.exp(s - m) * inv_z, 0.0)
            if HAS_Q:
                q = tl.load(qbase + offs, mask=offs < qlim, other=0.0).to(tl.float32)
            else:
                q = tl.where(offs == d, 1.0, 0.0)
            if EXPLICIT_E:
                ex = tl.load(exp_ptr + r * stride_e + offs, mask=mask, other=1.0)
            else:
                ex = _exp1(_uniform(key, offs))
            inv_e = 1.0 / ex
            kr = tl.where(mask, tl.maximum(p - q, 0.0) * inv_e, -1.0)
            kp = tl.where(mask, p * inv_e, -1.0)
            ur = kr > br
            bri = tl.where(ur, offs, bri)
            br = tl.where(ur, kr, br)
            up = kp > bp
            bpi = tl.where(up, offs, bpi)
            bp = tl.where(up, kp, bp)
        vr = tl.max(br, axis=0)
        ir = tl.min(tl.where(br == vr, bri, 2147483647), axis=0)
        vp = tl.max(bp, axis=0)
        ip = tl.min(tl.where(bp == vp, bpi, 2147483647), axis=0)
        o = r * NCHUNK + chunk
        tl.store(pr_ptr + o, vr)
        tl.store(pri_ptr + o, ir)
        tl.store(pp_ptr + o, vp)
        tl.store(ppi_ptr + o, ip)


@triton.jit
def _finalize_kernel(
    ds_ptr, ds_s, nacc_ptr, pr_ptr, pri_ptr, pp_ptr, ppi_ptr, out_ptr, stride_o, NCHUNK,
    NCHUNK_P2: tl.constexpr,
):
    r = tl.program_id(0)
    ds = tl.load(ds_ptr + r * ds_s) != 0
    if ds:
        c = tl.arange(0, NCHUNK_P2)
        cm = c < NCHUNK
        vr = tl.load(pr_ptr + r * NCHUNK + c, mask=cm, other=-1.0)
        ir = tl.load(pri_ptr + r * NCHUNK + c, mask=cm, other=2147483647)
        vp = tl.load(pp_ptr + r * NCHUNK + c, mask=cm, other=-1.0)
        ip = tl.load(ppi_ptr + r * NCHUNK + c, mask=cm, other=2147483647)
        br = tl.max(vr, axis=0)
        tr = tl.min(tl.where(vr == br, ir, 2147483647), axis=0)
        bp = tl.max(vp, axis=0)
        tp = tl.min(tl.where(vp == bp, ip, 2147483647), axis=0)
        tok = tl.where(br > 0, tr, tp).to(tl.int64)
        n = tl.load(nacc_ptr + r)
        tl.store(out_ptr + r * stride_o + n, tok)


def _chunking(n_programs_rows: int, V: int, block: int, target: int) -> tuple[int, int]:
    n_tiles = triton.cdiv(V, block)
    want = max(1, min(n_tiles, triton.cdiv(target, max(n_programs_rows, 1))))
    tiles = triton.cdiv(n_tiles, want)
    return triton.cdiv(n_tiles, tiles), tiles


_SM_COUNT: dict = {}


def _sm_count(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 1
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def verify_triton(p, block: int | None = None, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backend. ``p`` is an ``api._Prepared``; returns (num_accepted, output_tokens)."""
    logits = p.target_logits
    dev = logits.device
    N, V = logits.shape
    R, L = p.num_drafts.shape[0], p.max_draft_len
    out = torch.empty((R, L + 1), dtype=torch.int64, device=dev)
    nacc = torch.empty((R,), dtype=torch.int64, device=dev)
    if R == 0:
        return nacc, out
    if block is None:
        block = min(1024, triton.next_power_of_2(V))
    target = 4 * _sm_count(dev)
    ds, temp = p.do_sample, p.temperature
    pr_args = (ds, ds.stride(0), temp, temp.stride(0))
    has_thr = p.top_k is not None or p.top_p is not None
    thr = torch.empty((N,), dtype=torch.float32, device=dev)
    if has_thr:
        tk = p.top_k if p.top_k is not None else p.num_drafts
        tp = p.top_p if p.top_p is not None else thr
        _filter_kernel[(R, L + 1)](
            logits, logits.stride(0), p.num_drafts, p.cu_drafts, *pr_args,
            tk, tk.stride(0), tp, tp.stride(0), thr, V,
            HAS_K=p.top_k is not None, HAS_P=p.top_p is not None, BLOCK=min(256, block), num_warps=4,
        )
    nchunk, tiles = _chunking(N, V, block, target)
    pm = torch.empty((N, nchunk), dtype=torch.float32, device=dev)
    pz = torch.empty_like(pm)
    pi = torch.empty((N, nchunk), dtype=torch.int32, device=dev)
    _stats_kernel[(R, L + 1, nchunk)](
        logits, logits.stride(0), p.num_drafts, p.cu_drafts, *pr_args, thr, pm, pz, pi,
        V, nchunk, tiles, HAS_THR=has_thr, BLOCK=block, num_warps=num_warps,
    )
    q = p.draft_probs
    has_q = q is not None
    q_arg = q if has_q else thr
    stride_q = q.stride(0) if has_q else 0
    em = torch.empty((R,), dtype=torch.float32, device=dev)
    ez = torch.empty_like(em)
    key2 = torch.empty((R,), dtype=torch.int64, device=dev)
    draft = p.draft_ids if p.draft_ids.numel() > 0 else nacc  # never read when T == 0
    _accept_kernel[(R,)](
        logits, logits.stride(0), q_arg, stride_q, draft, p.num_drafts, p.cu_drafts, *pr_args,
        thr, pm, pz, pi, p.seeds, p.seeds.stride(0), p.offsets, p.offsets.stride(0), key2,
        p.uniforms if p.uniforms is not None else thr,
        out, out.stride(0), nacc, em, ez, nchunk, L + 1,
        HAS_Q=has_q, HAS_THR=has_thr, EXPLICIT_U=p.uniforms is not None,
        NCHUNK_P2=triton.next_power_of_2(nchunk), OUT_P2=triton.next_power_of_2(L + 1), num_warps=1,
    )
    if p.any_sample:
        nchunk_r, tiles_r = _chunking(R, V, block, target)
        pr = torch.empty((R, nchunk_r), dtype=torch.float32, device=dev)
        pri = torch.empty((R, nchunk_r), dtype=torch.int32, device=dev)
        pp = torch.empty_like(pr)
        ppi = torch.empty_like(pri)
        ex = p.exponentials
        _race_kernel[(R, nchunk_r)](
            logits, logits.stride(0), q_arg, stride_q, draft, p.num_drafts, p.cu_drafts, *pr_args,
            thr, nacc, em, ez, key2, ex if ex is not None else thr, ex.stride(0) if ex is not None else 0,
            pr, pri, pp, ppi, V, nchunk_r, tiles_r,
            HAS_Q=has_q, HAS_THR=has_thr, EXPLICIT_E=ex is not None, BLOCK=block, num_warps=num_warps,
        )
        _finalize_kernel[(R,)](
            ds, ds.stride(0), nacc, pr, pri, pp, ppi, out, out.stride(0), nchunk_r,
            NCHUNK_P2=triton.next_power_of_2(nchunk_r), num_warps=1,
        )
    return nacc, out
