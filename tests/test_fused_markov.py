"""The fused greedy Markov loop (`generation/fused_markov.py`) under TRITON_INTERPRET=1 (CPU): the drafts of
`DSparkDraftModel.draft_tokens` for one and many rows, ranks and vocabularies that do not fill a tile, float32 and
bfloat16 weights, ties going to the first index; the fallback for heads it does not cover and with
`DSPARK_FUSED_MARKOV=0`; `static_generate` and compiled `static_generate_batch` with it give plain `generate()`'s
tokens. Skipped without triton."""

from __future__ import annotations

# first: switches the interpreter on
from triton_interpreter import CountingKernel, child_only, interp, run_in_child_process

import pytest  # noqa: E402
import torch  # noqa: E402
from test_batched_generate import left_padded  # noqa: E402
from test_static_loop import counting_backend  # noqa: E402
from tiny_models import install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_target  # noqa: E402

from dspark_hf.generation import fused_markov, static_generate, static_generate_batch  # noqa: E402
from dspark_hf.generation.fused_markov import draft_tokens, fused_markov_applies  # noqa: E402
from dspark_hf.models import greedy_selector  # noqa: E402


@child_only
def test_in_child_process():
    run_in_child_process(__file__, timeout=600)


def markov_case(vocab, rank, batch, slots, dtype=torch.float32, seed=0, head_type="vanilla"):
    target = tiny_target(vocab_size=vocab)
    drafter = tiny_drafter(target, markov_rank=rank, head_type=head_type, seed=seed).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a bias as large as the base logits, so the predecessor decides many slots
        drafter.markov_head.markov_w1.weight.normal_(0.0, 1.0, generator=generator)
        drafter.markov_head.markov_w2.weight.normal_(0.0, rank ** -0.5, generator=generator)
    anchor = torch.randint(vocab, (batch,), generator=generator)
    hidden = torch.randn(batch, slots, drafter.config.hidden_size, generator=generator).to(dtype)
    base_logits = 3 * torch.randn(batch, slots, vocab, generator=generator)
    return drafter, anchor, hidden, base_logits


@interp
@pytest.mark.parametrize("vocab,rank,batch,slots,dtype", [
    (96, 16, 1, 4, torch.float32),
    (300, 32, 3, 7, torch.float32),  # vocabulary past two tiles, not a multiple of one
    (200, 128, 20, 5, torch.float32),  # rank in two chunks, batch past one row tile
    (150, 48, 2, 4, torch.float32),  # a rank that is not a power of two (the oracle drafters' 48)
    (150, 8, 3, 4, torch.float32),  # a rank below one dot tile
    (300, 64, 2, 6, torch.bfloat16),  # the bias rounded to bf16 before the float32 addition
])
def test_fused_markov_drafts_equal_the_drafters_loop(vocab, rank, batch, slots, dtype):
    drafter, anchor, hidden, base_logits = markov_case(vocab, rank, batch, slots, dtype)
    assert fused_markov_applies(drafter, base_logits)
    expected = drafter.draft_tokens(anchor, hidden, base_logits, greedy_selector).tokens
    drafts = draft_tokens(drafter, anchor, hidden, base_logits)[0]
    assert drafts.dtype == torch.long and drafts.shape == (batch, slots)
    assert torch.equal(drafts, expected)
    # the Markov bias changes drafts: slot i's token is not the base logits' argmax everywhere
    assert not torch.equal(drafts, base_logits.argmax(-1))


@interp
def test_fused_markov_ties_go_to_the_first_index():
    drafter, anchor, hidden, base_logits = markov_case(300, 16, 2, 3)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.zero_()
    base_logits.fill_(-1.0)
    base_logits[0, :, [7, 150, 299]] = 2.5  # equal maxima in three tiles
    base_logits[1, :, [200, 201]] = 0.0  # -0.0 and 0.0 are equal too
    base_logits[1, :, 200] = -0.0
    drafts = draft_tokens(drafter, anchor, hidden, base_logits)[0]
    assert drafts.tolist() == [[7, 7, 7], [200, 200, 200]]
    assert torch.equal(drafts, drafter.draft_tokens(anchor, hidden, base_logits, greedy_selector).tokens)


@interp
@pytest.mark.parametrize("head_type,rank", [("gated", 16), ("rnn", 16)])
def test_heads_the_kernel_does_not_cover_run_the_drafters_loop(head_type, rank):
    drafter, anchor, hidden, base_logits = markov_case(96, rank, 2, 4, head_type=head_type)
    assert not fused_markov_applies(drafter, base_logits)
    expected = drafter.draft_tokens(anchor, hidden, base_logits, greedy_selector).tokens
    assert torch.equal(draft_tokens(drafter, anchor, hidden, base_logits)[0], expected)


@interp
def test_the_environment_switch_turns_the_kernel_off(monkeypatch):
    drafter, anchor, hidden, base_logits = markov_case(96, 16, 2, 4)
    assert fused_markov_applies(drafter, base_logits)
    monkeypatch.setenv(fused_markov.SWITCH_VARIABLE, "0")
    assert not fused_markov_applies(drafter, base_logits)
    launches = []
    monkeypatch.setattr(fused_markov, "_markov_slot", CountingKernel(fused_markov._markov_slot, launches))
    expected = drafter.draft_tokens(anchor, hidden, base_logits, greedy_selector).tokens
    assert torch.equal(draft_tokens(drafter, anchor, hidden, base_logits)[0], expected) and not launches


@interp
def test_static_generate_with_the_fused_loop_equals_plain_generate(monkeypatch):
    vocab = 64
    target = make_bigram_like(tiny_target(vocab_size=vocab))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=4, markov_rank=vocab), target)
    launches = []
    monkeypatch.setattr(fused_markov, "_markov_slot", CountingKernel(fused_markov._markov_slot, launches))
    prompt = torch.tensor([[5, 9, 11, 4, 20, 33, 7]])
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24, eos_token_id=None)
    assert torch.equal(static_generate(target, drafter, prompt, 24, eos_token_id=[]), expected)
    assert launches and len(launches) % drafter.config.num_draft_slots == 0  # one launch per drafted slot
    assert sum(drafter.generation_stats.accepted) > 0  # (the oracle drafter: rounds accepted drafts)


@interp
def test_compiled_batch_rounds_run_the_kernel_as_one_operator(monkeypatch):
    """fullgraph=True: the operator traces inside the batch round; left-padded rows equal their solo `generate()`."""
    vocab = 64
    target = make_bigram_like(tiny_target(vocab_size=vocab))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=vocab), target, scale=3.0)
    launches = []
    monkeypatch.setattr(fused_markov, "_markov_slot", CountingKernel(fused_markov._markov_slot, launches))
    compilations, backend = counting_backend()
    torch._dynamo.reset()
    prompts = [[5, 9, 11, 4, 20, 33, 7], [40, 2, 17], [8, 8, 30, 12, 1]]
    ids, mask = left_padded(prompts)
    rows = static_generate_batch(target, drafter, ids, mask, 16, eos_token_id=[],
                                 compile=dict(backend=backend, fullgraph=True, dynamic=False))
    for prompt, row in zip(prompts, rows):
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
        assert row == expected[0, len(prompt):].tolist()
    assert len(compilations) == 1 and launches
    called = [str(node.target) for node in compilations[0].graph.nodes if node.op == "call_function"]
    assert any("dspark_hf.greedy_markov_drafts" in name for name in called), called


def served(target, drafter, gamma):
    """Six greedy requests of different lengths through a static engine on 4 rows: (their tokens, each round's
    accepted drafts per row)."""
    from dspark_hf.serving import DSparkEngine

    engine = DSparkEngine(target, drafter, max_batch_size=4, max_model_len=64, static=True, policy="fixed",
                          gamma=gamma, default_sampling={"temperature": 0})
    prompts = [[5, 9, 11], list(range(4, 20)), [7, 30, 8, 12, 40, 6], [33], [21, 22, 23, 24], [50, 3, 9, 9]]
    handles = [engine.add_request(prompt, max_tokens=8 + 5 * index) for index, prompt in enumerate(prompts)]
    engine.run()
    assert {entry["verify"][0] for entry in engine.round_log} == {gamma or drafter.config.num_draft_slots}
    return handles, [entry["accepted"] for entry in engine.round_log]


@interp
@pytest.mark.parametrize("gamma", [None, 2], ids=["all_drafts", "two_drafts"])
def test_static_engine_with_the_fused_loop_serves_exactly(monkeypatch, gamma):
    """`DSparkEngine(static=True)` (eager rounds on the CPU): requests of different lengths share the rows, rounds
    verify all γ drafts or the first 2 (the kernel then runs for 2 slots); every request equals its solo
    `generate()`, and every round accepts what it accepts with the drafter's own loop (`DSPARK_FUSED_MARKOV=0`)."""
    vocab = 64
    target = make_bigram_like(tiny_target(vocab_size=vocab, eos_token_id=2))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=vocab), target, scale=3.0)
    launches = []
    monkeypatch.setattr(fused_markov, "_markov_slot", CountingKernel(fused_markov._markov_slot, launches))
    handles, accepted = served(target, drafter, gamma)
    for handle in handles:
        expected = target.generate(torch.tensor([handle.prompt_ids]), max_new_tokens=handle.params.max_tokens,
                                   do_sample=False)
        assert handle.tokens == expected[0, len(handle.prompt_ids):].tolist()
    assert launches and len(launches) % (gamma or drafter.config.num_draft_slots) == 0
    assert any(max(row) > 0 for row in accepted)
    monkeypatch.setenv(fused_markov.SWITCH_VARIABLE, "0")
    launches.clear()
    assert served(target, drafter, gamma)[1] == accepted and not launches
