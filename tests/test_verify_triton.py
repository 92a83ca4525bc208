"""dspark_hf.verify, Triton backend under TRITON_INTERPRET=1 (CPU): identical results to the
torch reference given identical random numbers, edge cases, V = 151,936, and a chi-square
distribution test. Skipped when triton is not installed."""

from __future__ import annotations

import os
import sys

from triton_interpreter import child_only, interp, run_in_child_process  # first: switches the interpreter on

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_verify import ALPHA, check_distribution, make_case, stat_batch  # noqa: E402

from dspark_hf.verify import verify  # noqa: E402


@child_only
def test_in_child_process():
    run_in_child_process(__file__, timeout=900)  # (a guard against a hang: 125-250 s on a 2-core CI machine)


def both(*args, **kw):
    a = verify(*args, backend="torch", **kw)
    b = verify(*args, backend="triton", **kw)
    assert torch.equal(a.num_accepted, b.num_accepted), (a.num_accepted, b.num_accepted)
    assert torch.equal(a.output_tokens, b.output_tokens), (a.output_tokens, b.output_tokens)
    return a


@interp
def test_greedy_identical():
    d, nd, logits, q = make_case([0, 1, 3, 5, 2], V=40, seed=3)
    rows = torch.arange(d.numel()) + torch.repeat_interleave(torch.arange(5), nd)
    d = torch.where(torch.arange(d.numel()) % 3 != 2, logits[rows].argmax(-1), d)
    logits[0, 5] = logits[0, 17] = logits[0].max() + 1  # tie: lowest id wins in both
    res = both(d, nd, logits, None, do_sample=False)
    assert res.output_tokens[0, 0] == 5 and (res.num_accepted > 0).any()


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_identical_with_filters(dtype):
    lens = [0, 2, 4, 3, 1, 4]
    d, nd, logits, q = make_case(lens, V=48, seed=8, closeness=0.8, zero_frac=0.3, dtype=dtype)
    both(
        d, nd, logits, q,
        do_sample=torch.tensor([True, True, False, True, True, True]),
        temperature=torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 0.9]),
        top_k=torch.tensor([0, 5, 0, 1, 48, 9]),
        top_p=torch.tensor([1.0, 0.8, 1.0, 1.0, 0.5, 0.95]),
        seeds=torch.arange(6) * 1000 + 1,
        offsets=3,
    )


@interp
def test_strided_inputs_identical():
    """Views as a static batch passes them: the first v of each row's γ drafts (`drafts[:, :v].reshape(-1)`, a 1-D
    view with stride γ), per-request settings that are strided views. The kernel read draft_ids as contiguous once:
    the static engine's sampled rounds that verified fewer than γ drafts then tested other rows' drafts."""
    gamma, verify_count, rows = 3, 1, 7
    d, nd, logits, q = make_case([verify_count] * rows, V=32, seed=11, closeness=0.7)
    drafted = torch.zeros(rows, gamma, dtype=torch.int64)
    drafted[:, :verify_count] = d.view(rows, verify_count)
    drafted[:, verify_count:] = (d.view(rows, verify_count)[:, :1] + 5) % 32  # the drafts that are not verified
    strided = drafted[:, :verify_count].reshape(-1)
    assert strided.stride(0) == gamma
    settings = torch.tensor([[0.8, 1.3]] * rows)[:, 0]  # stride 2
    res = both(strided, nd, logits, q, do_sample=True, temperature=settings, seeds=torch.arange(rows) * 7 - 20)
    assert torch.equal(res.num_accepted, verify(d, nd, logits, q, do_sample=True, temperature=settings.clone(),
                                                seeds=torch.arange(rows) * 7 - 20, backend="torch").num_accepted)


@interp
def test_explicit_noise_one_hot_and_all_accepted():
    lens = [3, 0, 2, 4]
    V = 32
    d, nd, logits, q = make_case(lens, V=V, seed=13, closeness=1.0)
    rows = torch.arange(d.numel()) + torch.repeat_interleave(torch.arange(4), nd)
    q[:3] = logits[rows[:3]].softmax(-1)  # request 0: q == p -> all accepted, bonus from p
    g = torch.Generator().manual_seed(1)
    u = torch.rand(d.numel(), generator=g)
    e = torch.empty(4, V).exponential_(generator=g)
    res = both(d, nd, logits, q, uniforms=u, exponentials=e)
    assert res.num_accepted[0] == 3
    both(d, nd, logits, None, uniforms=u, exponentials=e)  # one-hot drafts
    both(d, nd, logits, None, seeds=torch.arange(4))


@interp
def test_large_vocab_few_rows():
    V = 151_936
    d, nd, logits, q = make_case([2, 0], V=V, seed=21, closeness=0.9, dtype=torch.bfloat16)
    both(d, nd, logits, q, do_sample=torch.tensor([True, False]), temperature=0.8, seeds=torch.tensor([5, 6]))


@interp
@pytest.mark.parametrize("pair,group", [(0, 1024), (2, 2)])
def test_distribution_triton(pair, group, monkeypatch):
    """Chi-square (alpha = 1e-3 per test) on the Triton kernel itself: first token, and the
    bonus token given a full accept; 150 requests (the interpreter is slow: 0.1-0.2 s a request), enough
    for gross errors. The kernel's tokens are also the torch reference's, draw for draw, and the
    reference's distribution is tested on 20 000 requests (test_verify.py). group 2: the two-level
    race over 4 groups of the 8 ids."""
    from dspark_hf.verify import rng

    monkeypatch.setattr(rng, "RACE_GROUP", group)
    d, nd, logits, q, kw, target = stat_batch(pair, R=150, V=8, l=1)
    res = verify(d, nd, logits, q, backend="triton", **kw)
    pv = check_distribution(res, target, 1)
    assert min(pv) > ALPHA, pv
    ref = verify(d, nd, logits, q, backend="torch", **kw)
    assert torch.equal(res.output_tokens, ref.output_tokens)


@interp
def test_top_k_candidates_identical(monkeypatch):
    """The top-k filter searches the values it gathered above a lower bound of the k-th largest;
    when they do not fit its buffer (here 16 values; also rows of equal logits, where every value
    ties) it searches the whole row. Both give the reference's tokens."""
    from dspark_hf.verify import triton_kernel as tk

    lens = [2, 3, 1, 2]
    d, nd, logits, q = make_case(lens, V=700, seed=12, closeness=0.8)
    logits[3:6] = 0.25  # request 1: every value ties
    gathered = []
    gather = tk._gather_at_least

    def counting(*a, **kw):
        n = gather(*a, **kw)
        gathered.append(int(n))
        return n

    monkeypatch.setattr(tk, "_gather_at_least", counting)
    kw = dict(top_k=torch.tensor([3, 2, 40, 7]), top_p=torch.tensor([1.0, 0.9, 0.8, 1.0]),
              temperature=torch.tensor([1.0, 0.8, 1.0, 1.2]), seeds=torch.arange(4) + 5)
    both(d, nd, logits, q, **kw)
    assert max(gathered) == 700 and min(gathered) < tk.FILTER_CANDIDATES, gathered  # tied rows: all
    monkeypatch.setattr(tk, "FILTER_CANDIDATES", 16)
    gathered.clear()
    both(d, nd, logits, q, **kw)
    assert any(n > 16 for n in gathered) and any(n <= 16 for n in gathered), gathered


@interp
def test_launch_configs_identical(monkeypatch):
    """Non-default LaunchConfigs (many chunks, masked tails, tl.range pipelining on and off) give the
    reference's tokens, through verify_triton(config=...) and set_launch_config."""
    import functools

    from dspark_hf.verify import triton_kernel as tk

    lens = [3, 0, 2, 5, 1]
    d, nd, logits, q = make_case(lens, V=300, seed=31, closeness=0.85, dtype=torch.bfloat16)
    mixed = dict(
        do_sample=torch.tensor([True, True, False, True, True]),
        temperature=torch.tensor([1.0, 0.7, 1.0, 1.2, 0.9]),
        top_k=torch.tensor([0, 40, 0, 0, 7]),
        top_p=torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0]),
    )
    cfgs = [
        tk.LaunchConfig(stats_block=32, stats_warps=1, stats_programs_per_sm=40, stats_stages=2,
                        race_warps=2, race_programs_per_sm=7, race_stages=3,
                        filter_block=64, filter_warps=2, filter_stages=3),
        tk.LaunchConfig(stats_block=64, stats_programs_per_sm=3, race_programs_per_sm=2, race_stages=1),
    ]
    orig = tk.verify_triton
    for cfg in cfgs:
        monkeypatch.setattr(tk, "verify_triton", functools.partial(orig, config=cfg))
        for draft_q in (q, None):
            both(d, nd, logits, draft_q, seeds=torch.arange(5) + 40, offsets=2, **mixed)
        both(d, nd, logits, q, do_sample=False)
    monkeypatch.setattr(tk, "verify_triton", orig)
    prev = tk.set_launch_config(cfgs[0])
    try:
        both(d, nd, logits, q, seeds=9, top_p=0.95)
    finally:
        tk.set_launch_config(prev)
    assert tk.get_launch_config() == prev


@interp
@pytest.mark.parametrize("group", [16, 64])
def test_group_race_identical(group, monkeypatch):
    """The two-level race with many groups (V = 300: 19 or 5 groups, a partial last one) split over
    several chunks per request: the reference's tokens for residual, one-hot and bonus draws and for a
    request whose residual has no mass (q == p: the flat race over p); explicit noise still races ids."""
    from dspark_hf.verify import rng

    monkeypatch.setattr(rng, "RACE_GROUP", group)
    lens = [3, 1, 2, 0, 5]
    d, nd, logits, q = make_case(lens, V=300, seed=5, closeness=0.7)
    top_k = torch.tensor([0, 5, 0, 0, 0])
    # request 1 (draft 3, target row 4): q is its top-5 p (up to 1e-5) and the draft has p = q = 0,
    # so it is rejected with no residual mass: the flat race over p emits one of the top 5
    top5 = logits[4].topk(5)
    logits[4, top5.indices] = top5.values[0]  # five equally likely tokens: only the noise picks one
    q[3] = torch.softmax(logits[4].double().masked_fill(logits[4] < top5.values[-1], -torch.inf), -1) * (1 + 1e-5)
    d[3] = logits[4].argmin()
    for draft_q, seeds in ((q, 11), (q, 12), (None, 11)):
        res = both(d, nd, logits, draft_q, seeds=seeds, top_k=top_k)
        assert (res.num_accepted < nd).any() and (res.num_accepted == nd).any()
        assert res.num_accepted[1] == 0 and res.output_tokens[1, 0] in top5.indices
    g = torch.Generator().manual_seed(1)
    both(d, nd, logits, q, uniforms=torch.rand(d.numel(), generator=g),
         exponentials=torch.empty(len(lens), 300).exponential_(generator=g))
