"""Lossless sampling: the first three generated tokens follow the target's exact (processed) distribution.

Each test draws N sequences with `generate(do_sample=True, assistant_model=drafter)` under a fixed seed and runs a
chi-square goodness-of-fit test against the distribution enumerated exactly from the target over a 6-token vocab
(216 three-token sequences; cells with expected count < 5 pooled). Significance ALPHA = 1e-3: with a correct
sampler a given seed fails with probability 0.1 %. The negative control shows the same test, at the same N,
rejects a target whose temperature is off by 15 %. The same test runs with each verify-length policy.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_target
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

import dspark_hf  # noqa: F401
from dspark_hf.scheduling import SPSTable

VOCAB, NEW_TOKENS, ALPHA = 6, 3, 1e-3
PROMPT = torch.tensor([[4, 1, 5]])


def exact_distribution(target, processors: LogitsProcessorList, prompt: list[int] | None = None
                       ) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) under the processed target, by enumeration (default prompt: PROMPT)."""
    prompt = PROMPT[0].tolist() if prompt is None else prompt
    probs = {(): 1.0}
    for _ in range(NEW_TOKENS):
        grown = {}
        for prefix, mass in probs.items():
            ids = torch.tensor([prompt + list(prefix)])
            with torch.no_grad():
                step = processors(ids, target(ids).logits[:, -1].float()).softmax(-1)[0]
            for token in range(VOCAB):
                grown[prefix + (token,)] = mass * float(step[token])
        probs = grown
    return probs


def chi_square_p_value(counts: dict, expected_probs: dict, total: int) -> float:
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for cell, prob in expected_probs.items():
        if prob * total >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(prob * total)
        else:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += prob * total
    if pooled_exp >= 5:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    else:  # too little mass for a cell of its own: fold it into the last kept cell
        observed[-1] += pooled_obs
        expected[-1] += pooled_exp
    expected = torch.tensor(expected, dtype=torch.float64)
    expected *= total / expected.sum()  # guard float rounding
    return float(chisquare(observed, expected.tolist()).pvalue)


def sample_counts(target, drafter, num_samples: int, seed: int, **sampling) -> tuple[dict, float]:
    torch.manual_seed(seed)
    counts, committed, verified = {}, [], []
    for _ in range(num_samples):
        out = target.generate(PROMPT, do_sample=True, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              assistant_model=drafter, top_k=0, **sampling)
        cell = tuple(out[0, PROMPT.shape[1]:].tolist())
        counts[cell] = counts.get(cell, 0) + 1
        committed += drafter.generation_stats.committed
        verified += drafter.generation_stats.drafted
    return counts, sum(committed) / max(1, len(committed)), verified


@pytest.fixture(scope="module")
def target():
    model = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB, eos_token_id=None), damping=0.3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # random init is nearly uniform; give the distribution some shape
    return model


def oracle_drafter(target, scale: float, forbidden: tuple[int, ...] = ()):
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=3, markov_rank=VOCAB), target, scale=scale)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight[list(forbidden)] = -1e4  # q(token) == 0 exactly for these
    return drafter


SPS = SPSTable([1, 2, 3, 4], [1.0, 0.8, 0.62, 0.5])  # a made-up throughput curve: verifying more costs more
POLICIES = {
    "fixed": {},
    "static_threshold": dict(dspark_policy="static_threshold", dspark_threshold=0.5),
    "hardware_aware": dict(dspark_policy="hardware_aware", dspark_sps_table=SPS),
    "hardware_aware_async": dict(dspark_policy="hardware_aware_async", dspark_sps_table=SPS),
}


@pytest.mark.parametrize(
    "sampling,processors,policy",
    [
        (dict(temperature=1.0), LogitsProcessorList(), "fixed"),
        (dict(temperature=0.7, top_p=0.8), LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.8)]),
         "fixed"),
        (dict(temperature=1.0), LogitsProcessorList(), "static_threshold"),
        (dict(temperature=1.0), LogitsProcessorList(), "hardware_aware"),
        (dict(temperature=1.0), LogitsProcessorList(), "hardware_aware_async"),
    ],
    ids=["t1.0", "t0.7-top_p0.8", "t1.0-threshold", "t1.0-hardware_aware", "t1.0-hardware_aware_async"],
)
def test_sampling_matches_target_distribution(target, sampling, processors, policy):
    drafter = oracle_drafter(target, scale=3.0)
    with torch.no_grad():  # make confidences depend clearly on the previous token, so policies cut variably
        drafter.confidence_head.proj.weight.mul_(40.0)
    num_samples = 2500
    counts, tau, verified = sample_counts(target, drafter, num_samples, seed=2024, **sampling, **POLICIES[policy])
    p_value = chi_square_p_value(counts, exact_distribution(target, processors), num_samples)
    assert p_value > ALPHA, p_value
    assert 1.1 < tau < 1.9  # drafts are sometimes accepted, sometimes not: accept, residual and bonus paths all ran
    if policy != "fixed":
        assert len(set(verified)) > 1  # the policy really varied the verify length


def test_sampling_with_zeros_in_draft_distribution(target):
    """Tokens 0 and 1 have q = 0 exactly: they can only come from the residual or the bonus."""
    drafter = oracle_drafter(target, scale=2.0, forbidden=(0, 1))
    num_samples = 2500
    counts, _, _ = sample_counts(target, drafter, num_samples, seed=7, temperature=1.0)
    p_value = chi_square_p_value(counts, exact_distribution(target, LogitsProcessorList()), num_samples)
    assert p_value > ALPHA, p_value
    assert any(0 in cell or 1 in cell for cell in counts)


def test_negative_control_detects_a_biased_sampler(target):
    """Same N and test against samples from a 15 %-hotter target: the test must reject (it can fail)."""
    truth = exact_distribution(target, LogitsProcessorList())
    biased = exact_distribution(target, LogitsProcessorList([TemperatureLogitsWarper(1.15)]))
    cells = list(itertools.product(range(VOCAB), repeat=NEW_TOKENS))
    generator = torch.Generator().manual_seed(3)
    draws = torch.multinomial(torch.tensor([biased[c] for c in cells]), 2500, replacement=True, generator=generator)
    counts = {}
    for index in draws.tolist():
        counts[cells[index]] = counts.get(cells[index], 0) + 1
    assert chi_square_p_value(counts, truth, 2500) < ALPHA


def test_draft_logits_are_exactly_what_tokens_were_drawn_from(target):
    """The q handed to verification equals processors(prefix, backbone + Markov logits) slot by slot."""
    drafter = oracle_drafter(target, scale=3.0)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.8)])
    generator = dspark_hf.DSparkCandidateGenerator(
        target, drafter, target.generation_config.__class__(do_sample=True, max_length=20), processors
    )
    prefill, no_logits = generator.get_candidates(PROMPT, is_first_iteration=True)  # the target prefills first
    assert prefill is PROMPT and no_logits is None
    with torch.no_grad(), generator.tap:
        outputs = target(PROMPT, output_hidden_states=True)  # the full tuple: layer i's output at i + 1
        ids = torch.cat([PROMPT, torch.tensor([[2]])], dim=1)
        torch.manual_seed(0)
        candidates, q_logits = generator.get_candidates(ids, model_outputs=outputs, is_first_iteration=False)
    drafts = candidates[:, ids.shape[1]:]
    # Recompute independently: backbone logits + Markov bias of the previous token, then the processors.
    from transformers import DynamicCache

    features = torch.cat([outputs.hidden_states[1], outputs.hidden_states[3]], dim=-1)  # target_layer_ids (0, 2)
    block = torch.tensor([[2] + [drafter.config.mask_token_id] * 2])
    hidden = drafter(block, features, position_ids=torch.arange(3, 6)[None], context_position_ids=torch.arange(3)[None],
                     past_key_values=DynamicCache()).last_hidden_state
    prev = torch.cat([ids[:, -1:], drafts[:, :-1]], dim=1)
    for slot in range(drafts.shape[1]):
        raw = drafter.compute_logits(hidden[:, slot]) + drafter.markov_head.markov_w2(
            drafter.markov_head.markov_w1(prev[:, slot])).float()
        expected = processors(torch.cat([ids, drafts[:, :slot]], dim=1), raw)
        torch.testing.assert_close(q_logits[:, slot], expected)
        assert torch.isfinite(expected[0, drafts[0, slot]])  # the drawn token has q > 0
