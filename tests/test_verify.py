"""dspark_hf.verify, torch backend: semantics vs an independent per-request loop, edge cases,
reproducibility, and a chi-square distribution test with negative controls (CPU, fast)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dspark_hf.verify import VerifyResult, verify
from dspark_hf.verify.reference import processed_scores

ALPHA = 1e-3  # false-alarm rate of each chi-square test


# ----------------------------------------------------------------------------- helpers
def hf_probs(row: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """transformers' own processing chain (same order as GenerationMixin) -> probabilities."""
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k is not None:
        procs.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs(None, row.float()[None].clone()).softmax(-1)[0]


def make_case(lens, V, seed=0, sharp=2.0, closeness=0.5, zero_frac=0.0, dtype=torch.float32):
    """Random ragged batch. Drafts are sampled from q; q is a perturbation of the target row
    (closeness in [0,1] controls the acceptance rate); zero_frac zeroes entries of q."""
    g = torch.Generator().manual_seed(seed)
    nd = torch.tensor(lens, dtype=torch.int64)
    R, T = len(lens), int(nd.sum())
    logits = torch.randn(T + R, V, generator=g) * sharp
    r_t = torch.repeat_interleave(torch.arange(R), nd)
    rows = torch.arange(T) + r_t
    ql = closeness * logits[rows] + (1 - closeness) * torch.randn(T, V, generator=g) * sharp
    q = ql.softmax(-1)
    if zero_frac > 0:
        q = q * (torch.rand(T, V, generator=g) >= zero_frac)
        q[torch.arange(T), q.argmax(-1)] += 1e-3  # keep every row non-empty
        q = q / q.sum(-1, keepdim=True)
    d = torch.multinomial(q, 1, generator=g).squeeze(1) if T else torch.zeros(0, dtype=torch.int64)
    return d, nd, logits.to(dtype), q


def naive_verify(d, nd, logits, q, do_sample, temperature, top_k, top_p, uniforms, expo):
    """Independent per-request implementation (HF warpers + HF's acceptance rule). ``expo``: explicit
    Exp(1) noise ``[R, V]`` (the flat race), or a ``race(r, weights, two_level)`` function."""
    R = nd.shape[0]
    out, ns, off = [], [], 0
    for r in range(R):
        lr = int(nd[r])
        row0 = off + r
        toks, n = [], 0
        for j in range(lr + 1):
            z = logits[row0 + j].float()
            if not do_sample[r]:
                best = int(z.argmax())
                if j < lr and int(d[off + j]) == best:
                    toks.append(best)
                    n += 1
                    continue
                toks.append(best)
                break
            p = hf_probs(z, float(temperature[r]), top_k[r], top_p[r])
            if j < lr:
                x = int(d[off + j])
                qx = float(q[off + j, x]) if q is not None else 1.0
                if qx > 0 and float(uniforms[off + j]) <= float(p[x]) / qx or qx == 0 and float(p[x]) > 0:
                    toks.append(x)
                    n += 1
                    continue
                qrow = q[off + j] if q is not None else torch.nn.functional.one_hot(torch.tensor(x), p.numel()).float()
                res = (p - qrow).clamp_min(0)
                dist = res if float(res.sum()) > 0 else p
            else:
                dist = res = p
            if callable(expo):
                toks.append(expo(r, dist, dist is res))
            else:
                toks.append(int((dist / expo[r]).argmax()))
            break
        out.append(toks)
        ns.append(n)
        off += lr
    return ns, out


def as_lists(res: VerifyResult):
    return res.num_accepted.tolist(), res.tokens_list()


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit; any sample on a zero-probability token fails outright."""
    V = probs.numel()
    counts = torch.bincount(tokens, minlength=V).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    exp = probs[support].double() * counts.sum()
    return float(chisquare(counts[support].numpy(), exp.numpy() * counts[support].sum().item() / exp.sum().item()).pvalue)


# ----------------------------------------------------------------------------- processing
@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.9, 20, 0.5), (1.0, 1, None), (1.0, None, 0.05), (2.0, 64, 0.95)],
)
def test_processing_matches_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 64, generator=g) * 3
    ours = processed_scores(
        logits,
        torch.full((16,), temperature),
        None if top_k is None else torch.full((16,), top_k),
        None if top_p is None else torch.full((16,), top_p),
    ).softmax(-1)
    ref = torch.stack([hf_probs(row, temperature, top_k, top_p) for row in logits])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)
    assert torch.equal(ours > 0, ref > 0)


def test_top_k_keeps_ties_like_transformers():
    row = torch.tensor([3.0, 1.0, 3.0, 2.0, 3.0, 0.0])
    ours = processed_scores(row[None], torch.ones(1), torch.tensor([2]), None).softmax(-1)[0]
    assert torch.equal(ours > 0, hf_probs(row, 1.0, 2, None) > 0)  # all three tied maxima kept


# ----------------------------------------------------------------------------- semantics
def test_greedy_matches_naive():
    d, nd, logits, q = make_case([0, 1, 3, 5, 2, 7], V=40, closeness=1.0, seed=3)
    # make some drafts exact argmaxes so that acceptance runs happen
    rows = torch.arange(d.numel()) + torch.repeat_interleave(torch.arange(6), nd)
    d = torch.where(torch.arange(d.numel()) % 3 != 2, logits[rows].argmax(-1), d)
    res = verify(d, nd, logits, q, do_sample=False, backend="torch")
    R = 6
    ns, toks = naive_verify(d, nd, logits, q, [False] * R, [1.0] * R, [None] * R, [None] * R, None, None)
    assert as_lists(res) == (ns, toks)
    assert res.output_tokens.shape == (R, 8)
    assert (res.num_accepted > 0).any() and (res.num_accepted < nd).any()


@pytest.mark.parametrize("one_hot", [False, True])
def test_sampling_matches_naive_given_same_noise(one_hot):
    lens = [0, 1, 3, 5, 2, 7, 4, 4]
    R, V = len(lens), 32
    d, nd, logits, q = make_case(lens, V=V, seed=5, closeness=0.8, zero_frac=0.3)
    g = torch.Generator().manual_seed(9)
    u = torch.rand(d.numel(), generator=g)
    expo = torch.empty(R, V).exponential_(generator=g)
    do_sample = [True, True, False, True, True, True, True, True]
    temperature = [1.0, 0.7, 1.0, 1.5, 1.0, 0.9, 1.0, 1.2]
    top_k = [0, 5, 0, 0, 1, 10, 3, 0]
    top_p = [1.0, 1.0, 1.0, 0.9, 1.0, 0.6, 1.0, 0.3]
    qq = None if one_hot else q
    res = verify(
        d, nd, logits, qq, do_sample=torch.tensor(do_sample), temperature=torch.tensor(temperature),
        top_k=torch.tensor(top_k), top_p=torch.tensor(top_p), uniforms=u, exponentials=expo, backend="torch",
    )
    hk = [k if k > 0 else None for k in top_k]
    ns, toks = naive_verify(d, nd, logits, qq, do_sample, temperature, hk, top_p, u, expo)
    assert as_lists(res) == (ns, toks)


def test_edge_cases():
    V = 24
    d, nd, logits, q = make_case([0, 3, 4, 2, 3], V=V, seed=11)
    R = 5
    rows = torch.arange(d.numel()) + torch.repeat_interleave(torch.arange(R), nd)
    # request 1: q == p exactly -> every draft is accepted, a bonus token follows
    p = logits[rows].softmax(-1)
    m1 = torch.repeat_interleave(torch.arange(R), nd) == 1
    q[m1] = p[m1]
    # request 2: drafts that the target's top-k filter removes (p(x) = 0) -> rejected at once
    m2 = torch.repeat_interleave(torch.arange(R), nd) == 2
    d[m2] = logits[rows[m2]].argmin(-1)
    # request 3: q has zeros everywhere except on the draft -> residual = p without x
    m3 = torch.repeat_interleave(torch.arange(R), nd) == 3
    q[m3] = torch.nn.functional.one_hot(d[m3], V).float()
    top_k = torch.tensor([0, 0, 4, 0, 1])  # request 4: top-k = 1 -> deterministic argmax
    res = verify(d, nd, logits, q, top_k=top_k, seeds=torch.arange(R), backend="torch")
    n, out = res.num_accepted, res.output_tokens
    assert n[0] == 0 and out[0, 0] >= 0 and (out[0, 1:] == -1).all()  # l = 0: just the bonus
    assert n[1] == 3 and (out[1, :3] == d[m1]).all() and out[1, 3] >= 0
    assert n[2] == 0 and out[2, 0] != d[m2][0]
    assert out[2, 0] in logits[rows[m2][0]].topk(4).indices
    assert 0 <= n[3] <= 2 and (n[3] == 2 or out[3, n[3]] != d[m3][n[3]])
    r4 = torch.repeat_interleave(torch.arange(R), nd) == 4
    amax4 = logits[rows[r4][0] : rows[r4][0] + 4].argmax(-1)
    emitted = out[4, : n[4] + 1]
    assert torch.equal(emitted, amax4[: n[4] + 1])  # top-k = 1: only argmaxes are ever emitted


def test_drafts_past_eos_are_plain_tokens():
    """verify() knows nothing about EOS: a run of drafts past EOS is verified token by token;
    cropping after EOS (the caller's job) gives the same decisions on the kept prefix."""
    V, eos = 20, 7
    d, nd, logits, q = make_case([6], V=V, seed=2, closeness=1.0)
    q = logits[:6].softmax(-1)
    d = torch.tensor([3, eos, 5, 1, 2, 9])
    q[torch.arange(6), d] = torch.maximum(q[torch.arange(6), d], torch.tensor(0.2))
    q = q / q.sum(-1, keepdim=True)
    full = verify(d, nd, logits, q, seeds=torch.tensor([4]), backend="torch")
    seeds, offsets = torch.tensor([4]), torch.tensor([0])
    ns, toks = naive_verify(d, nd, logits, q, [True], [1.0], [None], [None], _noise_for(seeds, offsets, nd, V)[0],
                            naive_group_race(seeds, offsets, 1024))
    assert as_lists(full) == (ns, toks)
    crop = verify(d[:2], torch.tensor([2]), torch.cat([logits[:2], logits[2:3]]), q[:2],
                  seeds=torch.tensor([4]), backend="torch")
    k = min(int(full.num_accepted), 2)
    assert int(crop.num_accepted) == k
    assert crop.output_tokens[0, :k].tolist() == full.output_tokens[0, :k].tolist()


def _noise_for(seeds, offsets, nd, V):
    from dspark_hf.verify import rng

    r_t = torch.repeat_interleave(torch.arange(nd.numel()), nd)
    j_t = torch.arange(r_t.numel()) - (torch.cumsum(nd, 0) - nd)[r_t]
    return rng.acceptance_uniforms(seeds, offsets, r_t, j_t), rng.residual_exponentials(seeds, offsets, V)


def naive_group_race(seeds, offsets, group: int):
    """The two-level exponential race of rng's counter noise, one request at a time (loops)."""
    from dspark_hf.verify import rng

    def race(r, w, two_level):
        key = (seeds[r : r + 1], offsets[r : r + 1])
        V = w.numel()
        e_v = rng.exponentials(*key, rng.STREAM_RESIDUAL, torch.arange(V))[0]
        ids = range(V)
        if two_level:  # group g wins with key mass_g / E_g, then its ids race
            n_groups = -(-V // group)
            e_g = rng.exponentials(*key, rng.STREAM_GROUP, torch.arange(n_groups))[0]
            g = max(range(n_groups), key=lambda i: (float(w[i * group : (i + 1) * group].sum() / e_g[i]), -i))
            ids = range(g * group, min(V, (g + 1) * group))
        return max(ids, key=lambda v: (float(w[v] * (1.0 / e_v[v])), -v))

    return race


@pytest.mark.parametrize("group", [None, 8, 1])
def test_counter_rng_is_what_verify_uses(group, monkeypatch):
    """Seeded noise: the two-level race (groups of rng.RACE_GROUP ids; 8 gives 4 groups at V = 30,
    1 makes every id a group) with rng's uniforms, as an independent per-request loop draws it."""
    from dspark_hf.verify import rng

    if group is not None:
        monkeypatch.setattr(rng, "RACE_GROUP", group)
    d, nd, logits, q = make_case([2, 0, 5, 3, 1, 4], V=30, seed=4, closeness=0.7)
    seeds, offs = torch.tensor([1, 2, 3, -(2**62), 8, 9]), torch.tensor([0, 5, 2**33, 7, 1, 2])
    a = verify(d, nd, logits, q, seeds=seeds, offsets=offs, backend="torch")
    u, _ = _noise_for(seeds, offs, nd, 30)
    R = nd.numel()
    ns, toks = naive_verify(d, nd, logits, q, [True] * R, [1.0] * R, [None] * R, [None] * R, u,
                            naive_group_race(seeds, offs, rng.RACE_GROUP))
    assert as_lists(a) == (ns, toks)
    assert (a.num_accepted < nd).any() and (a.num_accepted == nd).any()  # residual and bonus draws
    c = verify(d, nd, logits, q, seeds=seeds, offsets=offs, backend="torch")
    assert torch.equal(a.output_tokens, c.output_tokens)  # reproducible
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    x = verify(d, nd, logits, q, generator=g1, backend="torch")
    y = verify(d, nd, logits, q, generator=g2, backend="torch")
    assert torch.equal(x.output_tokens, y.output_tokens)


def test_uniforms_are_uniform_and_keys_differ():
    from dspark_hf.verify import rng

    u = rng.uniform(rng.stream_key(torch.tensor([123]), torch.tensor([0]), 1), torch.arange(200_000))
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u, bins=50, min=0, max=1)
    assert chisquare(counts.numpy()).pvalue > ALPHA
    k = rng.stream_key(torch.arange(1000), torch.zeros(1000, dtype=torch.int64), 1)
    assert k.unique().numel() == 1000


def test_input_validation():
    d, nd, logits, q = make_case([2, 1], V=10)
    with pytest.raises(ValueError, match="rows"):
        verify(d, nd, logits[:-1], q, backend="torch")
    with pytest.raises(ValueError, match="draft_probs"):
        verify(d, nd, logits, q[:, :5], backend="torch")
    with pytest.raises(ValueError, match="temperature"):
        verify(d, nd, logits, q, temperature=0.0, backend="torch")


# ----------------------------------------------------------------------------- distribution
PAIRS = [
    # (target sharpness, temperature, top_k, top_p, draft closeness, draft zero fraction)
    (1.0, 1.0, 0, 1.0, 0.3, 0.0),
    (1.5, 0.8, 6, 0.9, 0.5, 0.0),
    (1.0, 1.2, 0, 1.0, 0.0, 0.4),
]


def stat_batch(pair_idx: int, R: int, V: int, l: int = 2):
    """R independent requests sharing the same l+1 target rows and l draft rows."""
    sharp, temp, k, p, closeness, zf = PAIRS[pair_idx]
    g = torch.Generator().manual_seed(100 + pair_idx)
    rows = torch.randn(l + 1, V, generator=g) * sharp
    ql = closeness * rows[:l] + (1 - closeness) * torch.randn(l, V, generator=g) * sharp
    qd = ql.softmax(-1)
    if zf:
        qd = qd * (torch.rand(l, V, generator=g) >= zf)
        qd = qd / qd.sum(-1, keepdim=True)
    d = torch.multinomial(qd, R, replacement=True, generator=g).T.reshape(-1)  # [R*l]
    logits = rows.repeat(R, 1)
    q = qd.repeat(R, 1)
    nd = torch.full((R,), l)
    target = processed_scores(rows, torch.full((l + 1,), temp), torch.full((l + 1,), k), torch.full((l + 1,), p)).softmax(-1)
    kw = dict(temperature=temp, top_k=k, top_p=p, seeds=torch.arange(R) + 7919 * pair_idx)
    return d, nd, logits, q, kw, target


def check_distribution(res: VerifyResult, target: torch.Tensor, l: int) -> list[float]:
    n, out = res.num_accepted, res.output_tokens
    pv = [chi2_pvalue(out[:, 0], target[0])]
    for j in range(1, l + 1):  # token j exists iff the first j drafts were accepted
        sel = n >= j
        pv.append(chi2_pvalue(out[sel, j], target[j]))
    return pv


@pytest.mark.parametrize("group", [None, 4])
@pytest.mark.parametrize("pair", range(len(PAIRS)))
def test_output_distribution_is_target_distribution(pair, group, monkeypatch):
    """group 4: the two-level race over 3 groups of the 12 ids (None: one group)."""
    from dspark_hf.verify import rng

    if group is not None:
        monkeypatch.setattr(rng, "RACE_GROUP", group)
    d, nd, logits, q, kw, target = stat_batch(pair, R=20_000, V=12)
    res = verify(d, nd, logits, q, backend="torch", **kw)
    pv = check_distribution(res, target, 2)
    assert min(pv) > ALPHA, pv
    # acceptance rate is sum(min(p, q)) at the first position
    acc = (res.num_accepted >= 1).double().mean()
    expect = torch.minimum(target[0], q[0]).sum()
    assert abs(float(acc) - float(expect)) < 5 * (float(expect) * (1 - float(expect)) / 20_000) ** 0.5 + 1e-3


@pytest.mark.parametrize("pair", [0, 2])
def test_negative_controls_are_rejected(pair):
    """The harness has power: two deliberately wrong samplers fail the same chi-square test."""
    d, nd, logits, q, kw, target = stat_batch(pair, R=20_000, V=12)
    res = verify(d, nd, logits, q, backend="torch", **kw)
    first_draft = d.view(-1, 2)[:, 0]
    # 1) accept-always: the first token is the draft itself (distribution q)
    assert chi2_pvalue(first_draft, target[0]) < ALPHA
    # 2) on rejection resample from p instead of the residual max(p - q, 0)
    g = torch.Generator().manual_seed(0)
    resample = torch.multinomial(target[0], first_draft.numel(), replacement=True, generator=g)
    wrong = torch.where(res.num_accepted >= 1, first_draft, resample)
    assert chi2_pvalue(wrong, target[0]) < ALPHA


def test_negative_control_group_race(monkeypatch):
    """The two-level race needs its group noise: with E_g = 1 (the heaviest group always wins) the
    chi-square test of the first token rejects it."""
    from dspark_hf.verify import rng

    monkeypatch.setattr(rng, "RACE_GROUP", 4)
    exps = rng.exponentials

    def no_group_noise(seeds, offsets, stream, counters):
        e = exps(seeds, offsets, stream, counters)
        return torch.ones_like(e) if stream == rng.STREAM_GROUP else e

    monkeypatch.setattr(rng, "exponentials", no_group_noise)
    d, nd, logits, q, kw, target = stat_batch(0, R=20_000, V=12)
    res = verify(d, nd, logits, q, backend="torch", **kw)
    assert min(check_distribution(res, target, 2)) < ALPHA
