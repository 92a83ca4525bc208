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
def _uniform(key, counter):
    h = _mix32(counter.to(tl.uint32) ^ key)
    h = _mix32(h + key)
    return ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08


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
        shift: tl.constexpr = 28 - 4 * rnd
        low = tl.full((), (1 << shift) - 1, tl.uint32)
        probes = prefix | (probe_digits << shift) | low
        acc = tl.zeros([16], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < V
            s = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) / temp
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
    logits_ptr, stride_l, row_req_ptr, ds_ptr, temp_ptr, topk_ptr, topp_ptr, thr_ptr, V,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    req = tl.load(row_req_ptr + row)
    ds = tl.load(ds_ptr + req) != 0
    temp = tl.load(temp_ptr + req)
    thr = tl.full((), float("-inf"), tl.float32)
    base = logits_ptr + row.to(tl.int64) * stride_l
    k = tl.full((), 0, tl.int64)
    top_p = tl.full((), 1.0, tl.float32)
    if HAS_K:
        k = tl.load(topk_ptr + req).to(tl.int64)
    if HAS_P:
        top_p = tl.load(topp_ptr + req)
    need_k = ds & (k > 0) & (k < V)
    need_p = ds & (top_p < 1.0)
    if need_k | need_p:
        m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            s = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp
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
                s = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) / temp
                zk += tl.where(mask & (_key_of(s) >= lo_key), tl.exp(s - m), 0.0)
            bound = top_p * tl.sum(zk, axis=0)
            thr_key = _radix_search(base, V, temp, lo_key, m, bound, True, BLOCK)
        thr_key = tl.minimum(thr_key, _key_of(m))
        thr = _float_of(thr_key)
    tl.store(thr_ptr + row, thr)


@triton.jit
def _stats_kernel(
    logits_ptr, stride_l, row_req_ptr, ds_ptr, temp_ptr, thr_ptr, pm_ptr, pz_ptr, pi_ptr,
    V, NCHUNK, TILES,
    HAS_THR: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    req = tl.load(row_req_ptr + row)
    ds = tl.load(ds_ptr + req) != 0
    temp = tl.where(ds, tl.load(temp_ptr + req), 1.0)
    thr = float("-inf")
    if HAS_THR:
        thr = tl.load(thr_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_l
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    z_vec = tl.zeros([BLOCK], dtype=tl.float32)
    i_vec = tl.zeros([BLOCK], dtype=tl.int32)
    start0 = chunk * TILES * BLOCK
    for t in range(0, TILES):
        offs = start0 + t * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        s = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) / temp
        s = tl.where(s >= thr, s, float("-inf"))
        d = tl.where(s == float("-inf"), float("-inf"), s - m_vec)
        e = tl.exp(-tl.abs(d))
        up = d > 0
        z_vec = tl.where(up, z_vec * e + 1.0, z_vec + e)
        i_vec = tl.where(up, offs, i_vec)
        m_vec = tl.where(up, s, m_vec)
    m = tl.max(m_vec, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    z = tl.sum(z_vec * tl.exp(m_vec - m_safe), axis=0)
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
    logits_ptr, stride_l, q_ptr, stride_q, draft_ptr, nd_ptr, cu_ptr, ds_ptr, temp_ptr,
    thr_ptr, pm_ptr, pz_ptr, pi_ptr, key_ptr, unif_ptr,
    out_ptr, stride_o, nacc_ptr, em_ptr, ez_ptr, NCHUNK, OUT_W,
    HAS_Q: tl.constexpr, HAS_THR: tl.constexpr, EXPLICIT_U: tl.constexpr,
    NCHUNK_P2: tl.constexpr, OUT_P2: tl.constexpr,
):
    r = tl.program_id(0)
    l = tl.load(nd_ptr + r)
    off = tl.load(cu_ptr + r)
    row0 = off + r
    ds = tl.load(ds_ptr + r) != 0
    temp = tl.where(ds, tl.load(temp_ptr + r), 1.0)
    n = off * 0
    alive = ds | True
    for j in range(0, l):
        row = row0 + j
        m, z, amax = _merge_stats(pm_ptr, pz_ptr, pi_ptr, row, NCHUNK, NCHUNK_P2)
        d = tl.load(draft_ptr + off + j)
        s_d = tl.load(logits_ptr + row * stride_l + d).to(tl.float32) / temp
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
            u = _uniform(tl.load(key_ptr + r).to(tl.uint32), off * 0 + j)
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
    logits_ptr, stride_l, q_ptr, stride_q, draft_ptr, nd_ptr, cu_ptr, ds_ptr, temp_ptr,
    thr_ptr, nacc_ptr, em_ptr, ez_ptr, key_ptr, exp_ptr, stride_e,
    pr_ptr, pri_ptr, pp_ptr, ppi_ptr, V, NCHUNK, TILES,
    HAS_Q: tl.constexpr, HAS_THR: tl.constexpr, EXPLICIT_E: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    ds = tl.load(ds_ptr + r) != 0
    if ds:
        n = tl.load(nacc_ptr + r)
        l = tl.load(nd_ptr + r)
        off = tl.load(cu_ptr + r)
        e = off + r + n
        has_q = n < l
        qrow = off + n
        m = tl.load(em_ptr + r)
        z = tl.load(ez_ptr + r)
        temp = tl.load(temp_ptr + r)
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
            s = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) / temp
            p = tl.where(mask & (s >= thr), tl.exp(s - m) / z, 0.0)
            if HAS_Q:
                q = tl.load(qbase + offs, mask=offs < qlim, other=0.0).to(tl.float32)
            else:
                q = tl.where(offs == d, 1.0, 0.0)
            if EXPLICIT_E:
                ex = tl.load(exp_ptr + r * stride_e + offs, mask=mask, other=1.0)
            else:
                ex = -tl.log(_uniform(key, offs))
            kr = tl.where(mask, tl.maximum(p - q, 0.0) / ex, -1.0)
            kp = tl.where(mask, p / ex, -1.0)
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
    ds_ptr, nacc_ptr, pr_ptr, pri_ptr, pp_ptr, ppi_ptr, out_ptr, stride_o, NCHUNK,
    NCHUNK_P2: tl.constexpr,
):
    r = tl.program_id(0)
    ds = tl.load(ds_ptr + r) != 0
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
    if dev.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(dev).multi_processor_count
    else:
        target = 1
    ds = p.do_sample.to(torch.int8)
    has_thr = p.top_k is not None or p.top_p is not None
    thr = torch.empty((N,), dtype=torch.float32, device=dev)
    dummy_f = thr
    dummy_i = p.num_drafts
    if has_thr:
        _filter_kernel[(N,)](
            logits, logits.stride(0), p.row_request, ds, p.temperature,
            p.top_k if p.top_k is not None else dummy_i,
            p.top_p if p.top_p is not None else dummy_f,
            thr, V,
            HAS_K=p.top_k is not None, HAS_P=p.top_p is not None,
            BLOCK=min(256, block), num_warps=4,
        )
    nchunk, tiles = _chunking(N, V, block, target)
    pm = torch.empty((N, nchunk), dtype=torch.float32, device=dev)
    pz = torch.empty_like(pm)
    pi = torch.empty((N, nchunk), dtype=torch.int32, device=dev)
    _stats_kernel[(N, nchunk)](
        logits, logits.stride(0), p.row_request, ds, p.temperature, thr, pm, pz, pi,
        V, nchunk, tiles, HAS_THR=has_thr, BLOCK=block, num_warps=num_warps,
    )
    q = p.draft_probs
    has_q = q is not None
    q_arg = q if has_q else dummy_f
    stride_q = q.stride(0) if has_q else 0
    em = torch.empty((R,), dtype=torch.float32, device=dev)
    ez = torch.empty_like(em)
    draft = p.draft_ids if p.draft_ids.numel() > 0 else torch.zeros(1, dtype=torch.int64, device=dev)
    _accept_kernel[(R,)](
        logits, logits.stride(0), q_arg, stride_q, draft, p.num_drafts, p.cu_drafts, ds,
        p.temperature, thr, pm, pz, pi, rng.stream_key(p.seeds, p.offsets, rng.STREAM_ACCEPT),
        p.uniforms if p.uniforms is not None else dummy_f,
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
            logits, logits.stride(0), q_arg, stride_q, draft, p.num_drafts, p.cu_drafts, ds,
            p.temperature, thr, nacc, em, ez, rng.stream_key(p.seeds, p.offsets, rng.STREAM_RESIDUAL),
            ex if ex is not None else dummy_f, ex.stride(0) if ex is not None else 0,
            pr, pri, pp, ppi, V, nchunk_r, tiles_r,
            HAS_Q=has_q, HAS_THR=has_thr, EXPLICIT_E=ex is not None, BLOCK=block, num_warps=num_warps,
        )
        _finalize_kernel[(R,)](
            ds, nacc, pr, pri, pp, ppi, out, out.stride(0), nchunk_r,
            NCHUNK_P2=triton.next_power_of_2(nchunk_r), num_warps=1,
        )
    return nacc, out
