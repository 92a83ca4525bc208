"""Vectorised torch backend of :func:`dspark_hf.verify.verify` (the reference).

Materialises float32 ``[T + R, V]`` intermediates; no host synchronisation, no Python
control flow on device values. The Triton kernel computes the same quantities.
"""

from __future__ import annotations

import torch

from . import rng

NEG_INF = float("-inf")


def filter_thresholds(
    s: torch.Tensor, active: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Per-row threshold ``thr`` such that token v survives top-k then top-p iff ``s_v >= thr``.

    ``s``: ``float32[N, V]`` temperature-scaled logits; ``active``/``top_k``/``top_p``: per row.
    top-k keeps every token >= the k-th largest value (ties kept, as TopKLogitsWarper).
    top-p keeps v iff the mass of kept tokens strictly more likely than v is < top_p times
    the kept mass (TopPLogitsWarper's rule, except that tokens tied at the boundary are all
    kept instead of an order-dependent subset). The most likely token is always kept.
    """
    N, V = s.shape
    srt = s.sort(dim=-1, descending=True).values
    top = srt[:, 0]
    thr = torch.full((N,), NEG_INF, device=s.device)
    if top_k is not None:
        need_k = active & (top_k > 0) & (top_k < V)
        kk = torch.where(need_k, top_k, V).clamp(1, V)
        t_k = srt.gather(1, (kk - 1)[:, None]).squeeze(1)
        thr = torch.where(need_k, t_k, thr)
    if top_p is not None:
        need_p = active & (top_p < 1.0)
        w = torch.exp((srt - top[:, None]).double()) * (srt >= thr[:, None])
        zk = w.sum(-1, keepdim=True)
        before = torch.cumsum(w, -1) - w  # mass strictly before (= strictly greater, for a tie group's first member)
        keep = before < top_p.double()[:, None] * zk
        t_p = torch.where(keep, srt, torch.full_like(srt, float("inf"))).min(-1).values
        thr = torch.where(need_p, torch.maximum(thr, t_p), thr)
    return torch.minimum(thr, top)


def processed_scores(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 processed logits (temperature, top-k, top-p; filtered = -inf), one row per entry."""
    s = logits.float() * (1.0 / temperature.float())[:, None]
    if top_k is None and top_p is None:
        return s
    active = torch.ones(s.shape[0], dtype=torch.bool, device=s.device)
    thr = filter_thresholds(s, active, top_k, top_p)
    return torch.where(s >= thr[:, None], s, torch.full_like(s, NEG_INF))


def verify_torch(p) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch backend. ``p`` is an ``api._Prepared``; returns (num_accepted, output_tokens)."""
    logits = p.target_logits
    N, V = logits.shape
    R, T, L = p.num_drafts.shape[0], p.draft_ids.shape[0], p.max_draft_len
    dev = logits.device
    req = torch.repeat_interleave(torch.arange(R, device=dev), p.num_drafts + 1, output_size=N)
    ds_row = p.do_sample[req]
    temp_row = torch.where(ds_row, p.temperature[req], torch.ones_like(p.temperature[req]))
    s = logits.float() * (1.0 / temp_row)[:, None]  # reciprocal, as the kernel (<= 1 ulp from HF's z / T)
    if p.top_k is not None or p.top_p is not None:
        thr = filter_thresholds(
            s,
            ds_row,
            None if p.top_k is None else p.top_k[req],
            None if p.top_p is None else p.top_p[req],
        )
        s = torch.where(s >= thr[:, None], s, torch.full_like(s, NEG_INF))
    m = s.max(dim=-1).values
    amax = s.argmax(dim=-1)  # first maximal index
    z = torch.exp(s - m[:, None]).sum(-1)

    # --- acceptance, one decision per flat draft token
    flat = torch.arange(T, device=dev)
    r_t = torch.repeat_interleave(torch.arange(R, device=dev), p.num_drafts, output_size=T)
    j_t = flat - p.cu_drafts[r_t]
    row_t = flat + r_t
    d = p.draft_ids
    p_d = torch.exp(s[row_t, d] - m[row_t]) / z[row_t]
    q_d = p.draft_probs[flat, d].float() if p.draft_probs is not None else torch.ones(T, device=dev)
    if p.uniforms is not None:
        u = p.uniforms
    elif p.any_sample:
        u = rng.acceptance_uniforms(p.seeds, p.offsets, r_t, j_t)
    else:  # all greedy (known on the host): no noise needed
        u = torch.zeros(T, device=dev)
    acc = torch.where(p.do_sample[r_t], u * q_d < p_d, d == amax[row_t])
    acc_pad = torch.zeros(R, L + 1, dtype=torch.int64, device=dev)
    acc_pad[r_t, j_t] = acc.long()
    n = acc_pad.cumprod(dim=1).sum(dim=1)

    # --- the emitted token (row e = first rejected position, or the bonus row)
    e = p.cu_drafts + torch.arange(R, device=dev) + n
    tok = amax[e]
    if p.any_sample:
        s_e = s[e]
        p_e = torch.exp(s_e - m[e][:, None]) * (1.0 / z[e])[:, None]
        has_q = n < p.num_drafts
        qrow = (p.cu_drafts + n).clamp(max=max(T - 1, 0))
        if T == 0:
            q_e = torch.zeros_like(p_e)
        elif p.draft_probs is not None:
            q_e = p.draft_probs[qrow].float()
        else:
            q_e = torch.zeros_like(p_e).scatter_(1, d[qrow][:, None], 1.0)
        q_e = torch.where(has_q[:, None], q_e, torch.zeros_like(q_e))
        if p.exponentials is not None:
            tok_s = flat_race(p_e, q_e, p.exponentials)
        else:
            tok_s = group_race(p_e, q_e, p.seeds, p.offsets)
        tok = torch.where(p.do_sample, tok_s, tok)

    pos = torch.arange(L + 1, device=dev)
    dpad = torch.full((R, L + 1), -1, dtype=torch.int64, device=dev)
    dpad[r_t, j_t] = d
    out = torch.where(pos[None] < n[:, None], dpad, torch.full_like(dpad, -1))
    out = torch.where(pos[None] == n[:, None], tok[:, None], out)
    return n, out


def flat_race(p_e: torch.Tensor, q_e: torch.Tensor, E: torch.Tensor) -> torch.Tensor:
    """Explicit noise ``E [R, V]``: ``argmax_v max(p - q, 0)_v / E_v``, or ``argmax_v p_v / E_v`` when
    the residual has no mass (first id on ties)."""
    inv_e = 1.0 / E
    best_r, tok_r = ((p_e - q_e).clamp_min(0.0) * inv_e).max(dim=-1)
    return torch.where(best_r > 0, tok_r, (p_e * inv_e).argmax(dim=-1))


def group_keys(res: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[R, n_groups]`` first-level keys of the two-level race: each group's residual mass over its Exp(1) noise."""
    R, V = res.shape
    G = rng.RACE_GROUP
    n_groups = -(-V // G)
    mass = torch.nn.functional.pad(res, (0, n_groups * G - V)).view(R, n_groups, G).sum(-1)
    return mass / rng.exponentials(seeds, offsets, rng.STREAM_GROUP, torch.arange(n_groups, device=res.device))


def group_race(p_e: torch.Tensor, q_e: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Counter-based noise: the two-level exponential race (exactly a sample of the normalised residual).

    The ids are split into groups of ``rng.RACE_GROUP``. Group g wins with key ``mass_g / E_g``
    (``mass_g`` = its residual mass, ``E_g`` from ``STREAM_GROUP``), i.e. with probability
    ``mass_g / total``; inside it id v wins with key ``max(p - q, 0)_v / E_v`` (``STREAM_RESIDUAL``),
    i.e. with probability ``res_v / mass_g``. With no residual mass: ``argmax_v p_v / E_v``."""
    V = p_e.shape[1]
    res = (p_e - q_e).clamp_min(0.0)
    G = rng.RACE_GROUP
    best_g, g = group_keys(res, seeds, offsets).max(-1)
    ids = g[:, None] * G + torch.arange(G, device=p_e.device)[None, :]
    inside = ids < V
    ids = ids.clamp(max=V - 1)
    inv_e = 1.0 / rng.exponentials(seeds, offsets, rng.STREAM_RESIDUAL, ids)
    key = torch.where(inside, res.gather(1, ids) * inv_e, -1.0)
    tok_g = ids.gather(1, key.argmax(-1, keepdim=True)).squeeze(1)
    tok_p = (p_e * (1.0 / rng.residual_exponentials(seeds, offsets, V))).argmax(dim=-1)
    return torch.where(best_g > 0, tok_g, tok_p)
