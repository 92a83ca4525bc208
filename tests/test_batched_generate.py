"""Batched DSpark `generate()` (batch > 1, left padding): lossless per row, per-row verify and accepted lengths.

Greedy: every row of several left-padded batches equals its solo plain `generate()` token for token (float32), for
tiny Qwen3 and Llama targets, with a random drafter (almost nothing accepted) and a bigram-oracle drafter (rows
accept different lengths in the same round), with cache compaction always / at the default threshold / never.
Sampling: per row, a chi-square test against the exactly enumerated distribution (see the module docstring of
test_generation_sampling.py; here all samples of one prompt are rows of a single batched call).
"""

from __future__ import annotations

import pytest
import torch
from test_generation_sampling import ALPHA, NEW_TOKENS, VOCAB, chi_square_p_value, exact_distribution, oracle_drafter
from tiny_models import install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_target
from transformers import LogitsProcessorList, StoppingCriteria, TemperatureLogitsWarper, TopPLogitsWarper

import dspark_hf  # noqa: F401  (installs the generate() hook)
from dspark_hf.generation import speculative_rows
from dspark_hf.scheduling import SPSTable


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    return ids, mask


def random_batches(vocab: int, count: int, size: int, seed: int) -> list[list[list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.randint(1, 12, (size,), generator=generator).tolist()
        batches.append([torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths])
    return batches


def assert_rows_equal_solo(target, drafter, batches, max_new: int, **kwargs):
    for prompts in batches:
        ids, mask = left_padded(prompts)
        out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new, assistant_model=drafter, **kwargs)
        pad = target.generation_config.eos_token_id if target.generation_config.pad_token_id is None else None
        for i, prompt in enumerate(prompts):
            solo = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, **kwargs)[0, len(prompt):]
            row = out[i, ids.shape[1]:]
            assert torch.equal(row[: solo.numel()], solo), (prompt, row.tolist(), solo.tolist())
            if pad is not None:  # after eos: padding, as plain batched generate()
                assert (row[solo.numel():] == pad).all()


@pytest.fixture(params=[0.5, -1.0, 2.0], ids=["compact-default", "compact-always", "compact-never"])
def compaction(request, monkeypatch):
    original = speculative_rows.SpeculativeRows.__init__

    def patched(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.compact_threshold = request.param

    monkeypatch.setattr(speculative_rows.SpeculativeRows, "__init__", patched)
    return request.param


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_rows_equal_solo_generate_random_drafter(family, compaction):
    target = tiny_target(family)
    drafter = tiny_drafter(target, block_size=4)
    assert_rows_equal_solo(target, drafter, random_batches(96, count=3, size=4, seed=11), max_new=12, do_sample=False)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_rows_equal_solo_generate_oracle_drafter(family, compaction):
    target = make_bigram_like(tiny_target(family, vocab_size=48, eos_token_id=2))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=7, markov_rank=48), target)
    accepted_rounds = []
    for prompts in random_batches(48, count=3, size=5, seed=5):
        assert_rows_equal_solo(target, drafter, [prompts], max_new=30, do_sample=False)
        rows = drafter.generation_stats.rows
        accepted_rounds += [[r.accepted[k] for r in rows if len(r.accepted) > k] for k in range(3)]
    assert drafter.generation_stats.tau > 1.5
    assert any(len(set(round_)) > 1 for round_ in accepted_rounds)  # rows accepted different lengths in one round


@pytest.mark.parametrize("policy", [dict(dspark_policy="static_threshold", dspark_threshold=0.3),
                                    dict(dspark_policy="hardware_aware",
                                         dspark_sps_table=SPSTable([1, 4, 16, 64], [1.0, 0.9, 0.6, 0.2]))],
                         ids=["threshold", "hardware_aware"])
def test_greedy_with_per_row_verify_lengths(policy):
    target = make_bigram_like(tiny_target("qwen3", vocab_size=48, eos_token_id=2))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=7, markov_rank=48), target)
    batches = random_batches(48, count=2, size=5, seed=9)
    assert_rows_equal_solo(target, drafter, batches, max_new=25, do_sample=False, **policy)
    verified = [length for row in drafter.generation_stats.rows for length in row.drafted]
    assert len(set(verified)) > 2


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_processors_and_stop_conditions_match_plain_batched_generate():
    """Processors see each row as plain batched generate() does (padded prompt + own tokens)."""
    target = make_bigram_like(tiny_target("qwen3", vocab_size=48, eos_token_id=[2, 5]))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=48), target)
    settings = [dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2),
                dict(min_new_tokens=6, repetition_penalty=0.8), dict(max_new_tokens=3),
                dict(stopping_criteria=[StopAfterToken(7)])]
    for kwargs in settings:
        kwargs = {"max_new_tokens": 24, **kwargs}
        for prompts in random_batches(48, count=2, size=4, seed=3):
            ids, mask = left_padded(prompts, pad_id=1)
            plain = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kwargs)
            ours = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, assistant_model=drafter,
                                   **kwargs)
            assert torch.equal(ours, plain[:, : ours.shape[1]]), kwargs
            assert (plain[:, ours.shape[1]:] == 0).all()


def test_return_dict_and_clear_errors():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    ids, mask = left_padded([[5, 6, 7], [8, 9]])
    out = target.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=drafter,
                          return_dict_in_generate=True)
    assert out.sequences.shape[0] == 2
    with pytest.raises(ValueError, match="sequences only"):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=drafter,
                        return_dict_in_generate=True, output_scores=True)
    with pytest.raises(ValueError, match="empty prompt"):
        target.generate(ids, attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]), max_new_tokens=4,
                        assistant_model=drafter)
    sliding = tiny_target("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    if any(t != "full_attention" for t in sliding.config.layer_types):
        with pytest.raises(ValueError, match="full-attention"):
            sliding.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=tiny_drafter(sliding))


# ---------------------------------------------------------------------------- sampling, per row
PROMPTS = [[4, 1, 5], [3], [2, 0, 4, 4, 1]]  # different lengths: rows are left-padded differently
COPIES = 2000


@pytest.fixture(scope="module")
def sampling_target():
    model = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB, eos_token_id=None), damping=0.3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    return model


@pytest.mark.parametrize(
    "sampling,processors,policy",
    [
        (dict(temperature=1.0), LogitsProcessorList(), {}),
        (dict(temperature=0.7, top_p=0.8), LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.8)]),
         dict(dspark_policy="static_threshold", dspark_threshold=0.5)),
    ],
    ids=["t1.0-fixed", "t0.7-top_p0.8-threshold"],
)
def test_sampling_each_row_matches_target_distribution(sampling_target, sampling, processors, policy):
    """COPIES rows per prompt in one batched call; one chi-square test per prompt at ALPHA = 1e-3 (a correct
    sampler fails a given seed with probability <= 0.3 % over the three prompts)."""
    target = sampling_target
    drafter = oracle_drafter(target, scale=3.0)
    with torch.no_grad():
        drafter.confidence_head.proj.weight.mul_(40.0)
    rows = [prompt for prompt in PROMPTS for _ in range(COPIES)]
    ids, mask = left_padded(rows)
    torch.manual_seed(2024)
    out = target.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, top_k=0, assistant_model=drafter, **sampling, **policy)
    generated = out[:, ids.shape[1]:].tolist()
    for p, prompt in enumerate(PROMPTS):
        counts = {}
        for cell in generated[p * COPIES:(p + 1) * COPIES]:
            counts[tuple(cell)] = counts.get(tuple(cell), 0) + 1
        p_value = chi_square_p_value(counts, exact_distribution(target, processors, prompt), COPIES)
        assert p_value > ALPHA, (prompt, p_value)
    stats = drafter.generation_stats
    assert 1.1 < stats.tau < 2.5
    if policy:
        assert len({length for row in stats.rows for length in row.drafted}) > 1
