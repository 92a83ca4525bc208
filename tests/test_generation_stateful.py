"""Targets whose cache cannot be cropped (`target_is_stateful`): generate() runs dspark_hf's stateful loop (cache copy
before verifying, restore and re-feed after a partial accept) and stays lossless. A plain Qwen3 flagged `_is_stateful`
isolates the loop; a tiny Qwen3-Next (linear-attention layers whose conv and recurrent states are updated in place) is
a real hybrid: transformers < 5.25 flags it stateful, later releases roll its states back themselves (past recording),
so it runs in transformers' loop there. DeepSeek-V4 targets are in test_formats_v4.py."""

from __future__ import annotations

import pytest
import torch
from test_generation_sampling import ALPHA, NEW_TOKENS, PROMPT, VOCAB, chi_square_p_value, exact_distribution, oracle_drafter
from tiny_models import install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_target
from transformers import LogitsProcessorList, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.cache_utils import DynamicCache

import dspark_hf.generation.stateful as stateful
from dspark_hf.generation.target_features import target_is_stateful

NEW = 24


def stateful_qwen3(**kwargs):
    target = make_bigram_like(tiny_target("qwen3", eos_token_id=None, **kwargs), damping=0.3)
    target._is_stateful = True  # as transformers flags recurrent / compressor models
    return target


def qwen3_next():
    config = Qwen3NextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"] * 2, eos_token_id=None, pad_token_id=None, bos_token_id=None,
    )
    torch.manual_seed(0)
    return make_bigram_like(Qwen3NextForCausalLM(config).eval(), damping=0.3)


def forbid_cropping(monkeypatch):
    """Fails the test if anything crops a cache (the stateful loop never does)."""
    monkeypatch.setattr(DynamicCache, "crop", lambda *a, **k: pytest.fail("a stateful target's cache was cropped"))


@pytest.fixture
def never_cropped(monkeypatch):
    forbid_cropping(monkeypatch)


@pytest.mark.parametrize("build", [stateful_qwen3, qwen3_next], ids=["qwen3-flagged-stateful", "qwen3-next"])
def test_stateful_target_is_lossless(build, monkeypatch):
    target = build()
    stateful_loop = target_is_stateful(target)
    assert stateful_loop or build is qwen3_next  # Qwen3-Next is stateful only for transformers < 5.25
    if stateful_loop:
        forbid_cropping(monkeypatch)
    drafters = {"random": tiny_drafter(target, block_size=4, target_layer_ids=(1, 3)),
                "oracle": install_bigram_oracle(tiny_drafter(target, block_size=4, markov_rank=96,
                                                             target_layer_ids=(1, 3)), target)}
    rounds = {name: [] for name in drafters}
    generator = torch.Generator().manual_seed(3)
    for n in (1, 7, 19):
        ids = torch.randint(4, 96, (1, n), generator=generator)
        reference = target.generate(ids, max_new_tokens=NEW, do_sample=False)
        for name, drafter in drafters.items():
            out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=drafter)
            assert torch.equal(out, reference), (name, n)
            rounds[name] += list(zip(drafter.generation_stats.drafted[:-1], drafter.generation_stats.accepted[:-1]))
    assert any(0 < a < d for d, a in rounds["oracle"]) and any(0 < a == d for d, a in rounds["oracle"])
    if stateful_loop:
        assert (0, 0) in rounds["random"]  # re-fed tokens reached the limit: a round verified no drafts


def test_stateful_target_stops_at_eos_like_plain_decoding(never_cropped):
    """eos inside accepted drafts, prompts that end in eos, a repetition penalty: same tokens as plain decoding."""
    target = make_bigram_like(tiny_target("qwen3", vocab_size=48), damping=0.05)
    with torch.no_grad():
        eos = int(target(torch.arange(48)[:, None]).logits[:, -1].argmax(-1).mode().values)  # a frequent next token
    target.generation_config.eos_token_id = eos
    target._is_stateful = True
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=7, markov_rank=48), target)
    generator = torch.Generator().manual_seed(1)
    stopped = 0
    for i in range(12):
        ids = torch.randint(0, 48, (1, int(torch.randint(1, 10, (1,), generator=generator))), generator=generator)
        if i % 4 == 0:
            ids[0, -1] = eos
        kwargs = dict(max_new_tokens=20, do_sample=False, repetition_penalty=1.3 if i % 2 else 1.0)
        reference = target.generate(ids, **kwargs)
        assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), reference), i
        stopped += int(reference[0, -1] == eos and reference.shape[1] < ids.shape[1] + 20)
    assert stopped >= 6


def test_refeed_limit_bounds_the_verify_forward(monkeypatch):
    """Re-fed tokens grow over consecutive partial accepts until a round verifies no drafts and commits them: with a
    limit of one block (4), a forward feeds at most 3 re-fed tokens + anchor + 4 drafts, or (flush) < 9 + anchor."""
    target = stateful_qwen3()
    drafter = tiny_drafter(target, block_size=4)
    monkeypatch.setattr(stateful, "MAX_REFEED_BLOCKS", 1)
    ids = torch.tensor([[5, 9, 11]])
    reference = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    widths = []
    original = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: widths.append(k["input_ids"].shape[1]) or original(*a, **k))
    out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, reference)
    assert widths[0] == 3 and max(widths[1:]) <= 9 and max(widths[1:]) > 5  # prefill, then bounded rounds
    assert (0, 0) in zip(drafter.generation_stats.drafted, drafter.generation_stats.accepted)


@pytest.mark.slow
def test_stateful_sampling_matches_target_distribution():
    """The chi-square test of test_generation_sampling.py (same N, same ALPHA) through the stateful loop."""
    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB, eos_token_id=None), damping=0.3)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    target._is_stateful = True
    drafter = oracle_drafter(target, scale=3.0)
    num_samples = 2500
    torch.manual_seed(2024)
    counts, committed = {}, []
    for _ in range(num_samples):
        out = target.generate(PROMPT, do_sample=True, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              assistant_model=drafter, top_k=0)
        cell = tuple(out[0, PROMPT.shape[1]:].tolist())
        counts[cell] = counts.get(cell, 0) + 1
        committed += drafter.generation_stats.committed
    p_value = chi_square_p_value(counts, exact_distribution(target, LogitsProcessorList()), num_samples)
    assert p_value > ALPHA, p_value
    assert 1.1 < sum(committed) / len(committed) < 1.9  # accepts and rejections both happened


def test_batched_generate_refuses_a_stateful_target():
    target = stateful_qwen3()
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="stateful"):
        target.generate(torch.tensor([[5, 6], [7, 8]]), attention_mask=torch.ones(2, 2, dtype=torch.long),
                        max_new_tokens=4, assistant_model=drafter)
