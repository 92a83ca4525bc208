"""Lossless greedy decoding: `generate(assistant_model=drafter)` equals plain `generate()` token for token (float32)."""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import char_tokenizer, install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_target
from transformers.generation.streamers import BaseStreamer

import dspark_hf  # noqa: F401  (installs the generate() hook)

NUM_PROMPTS = 50
MAX_NEW = 12
HEADS = [(0, None), (8, "vanilla"), (8, "gated"), (8, "rnn")]  # rank 0 = plain DFlash


def prompts(vocab: int, count: int = NUM_PROMPTS, seed: int = 123) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (count,), generator=generator)
    return [torch.randint(4, vocab, (1, int(n)), generator=generator) for n in lengths]


@functools.cache
def target_and_references(family: str):
    target = tiny_target(family)
    inputs = prompts(target.config.vocab_size)
    with torch.no_grad():
        references = [target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False) for ids in inputs]
    return target, inputs, references


# Every (family, head) pair, each with one block size, such that every block size also meets every family and every
# head (all pairs of the three factors: 12 cases instead of the 36 of every combination).
FAMILIES, BLOCK_SIZES = ["qwen3", "llama", "gemma"], [1, 4, 7]
HEAD_IDS = ["dflash", "vanilla", "gated", "rnn"]
CASES = [pytest.param(family, BLOCK_SIZES[(f + h) % 3], *head, id=f"{family}-{HEAD_IDS[h]}-{BLOCK_SIZES[(f + h) % 3]}")
         for f, family in enumerate(FAMILIES) for h, head in enumerate(HEADS)]


@pytest.mark.parametrize("family,block_size,markov_rank,head_type", CASES)
def test_greedy_equals_plain_generate(family, block_size, markov_rank, head_type):
    target, inputs, references = target_and_references(family)
    drafter = tiny_drafter(target, block_size=block_size, markov_rank=markov_rank, head_type=head_type or "vanilla",
                           confidence=markov_rank > 0)
    rounds = 0
    for ids, reference in zip(inputs, references):
        out = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, reference), f"prompt {ids.tolist()}"
        rounds += drafter.generation_stats.rounds
        assert max(drafter.generation_stats.drafted, default=0) <= block_size
    assert rounds > 0


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_good_drafter_exercises_acceptance_and_stays_lossless(family):
    """A bigram-oracle drafter on a nearly-bigram target: long accepts, bonus tokens and eos inside drafts."""
    target = make_bigram_like(tiny_target(family, vocab_size=48, eos_token_id=2))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=7, markov_rank=48), target)
    committed, drafted, full_accepts = [], [], 0
    for ids in prompts(48, count=30):
        reference = target.generate(ids, max_new_tokens=40, do_sample=False)
        out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, reference)
        stats = drafter.generation_stats
        committed += stats.committed
        drafted += stats.drafted
        full_accepts += sum(c == d + 1 for c, d in zip(stats.committed, stats.drafted))
    tau = sum(committed) / len(committed)
    assert tau > 2.0, tau  # the oracle is good: rounds accept several drafts (a random drafter gives ~1.0)
    assert full_accepts > 0 and any(c == 1 for c in committed)  # both full accepts and first-slot rejections


def test_greedy_with_logits_processors_and_stop_conditions():
    """Repetition penalty, no-repeat n-grams, min_new_tokens and an eos all behave as in plain decoding."""
    target = make_bigram_like(tiny_target("qwen3", vocab_size=48, eos_token_id=[2, 5]))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=48), target)
    settings = [
        dict(repetition_penalty=1.3),
        dict(no_repeat_ngram_size=2),
        dict(min_new_tokens=6, repetition_penalty=0.8),
        dict(max_new_tokens=3),
    ]
    for kwargs in settings:
        kwargs = {"max_new_tokens": 30, **kwargs}
        for ids in prompts(48, count=15, seed=7):
            reference = target.generate(ids, do_sample=False, **kwargs)
            out = target.generate(ids, do_sample=False, assistant_model=drafter, **kwargs)
            assert torch.equal(out, reference), (kwargs, ids.tolist())


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1))

    def end(self):
        self.ended = True


def test_streamer_receives_exactly_the_output():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4)
    ids = prompts(96, count=1)[0]
    streamer = _Collect()
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter, streamer=streamer)
    assert streamer.ended
    assert torch.equal(torch.cat(streamer.chunks), out[0])  # the prompt first, then every accepted chunk


def test_first_draft_reads_the_whole_prompt():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, block_size=4)
    seen = []
    original = drafter.draft

    def spy(anchor_ids, target_hidden_states, past_key_values, **kwargs):
        seen.append((target_hidden_states.shape[1], past_key_values.get_seq_length(),
                     kwargs["position_ids"][0, 0].item()))
        return original(anchor_ids, target_hidden_states, past_key_values, **kwargs)

    drafter.draft = spy
    ids = prompts(96, count=1, seed=5)[0]
    out = target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=drafter)
    prompt_len = ids.shape[1]
    assert seen[0] == (prompt_len, 0, prompt_len)  # all prompt features, anchor at the first new position
    # Afterwards the cache always ends right before the anchor: features of every committed token, nothing else.
    for new_context, cached, anchor_position in seen[1:]:
        assert cached + new_context == anchor_position
    assert seen[-1][2] < out.shape[1]


def test_a_tap_on_the_last_layer_reads_it_before_the_final_norm(monkeypatch):
    """transformers returns the last layer only after the final norm; the drafter gets the raw layer output, and stays
    lossless. Checked hook-free: with the final norm replaced by the identity, `hidden_states[-1]` is that output."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, block_size=4, target_layer_ids=(0, 3))
    seen = []
    original = drafter.draft
    drafter.draft = lambda anchor, features, cache, **kwargs: seen.append(features) or original(anchor, features, cache,
                                                                                                   **kwargs)
    ids = prompts(96, count=1, seed=5)[0]
    out = target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, target.generate(ids, max_new_tokens=10, do_sample=False))
    monkeypatch.setattr(target.model, "norm", torch.nn.Identity())
    with torch.no_grad():
        raw = target(ids, output_hidden_states=True).hidden_states  # embedding output first: layer i at i + 1
    torch.testing.assert_close(seen[0], torch.cat([raw[1], raw[4]], dim=-1))


def test_nested_taps_keep_their_hooks_until_the_outermost_block_ends():
    """A round compiled with its tap (`StaticBatchRounds`) may run inside a caller's `with tap:`: the inner block's end
    must not remove the hooks the outer one still reads through."""
    from dspark_hf.models import TargetLayerTap

    target = tiny_target("qwen3")
    ids = prompts(96, count=1, seed=5)[0]
    tap = TargetLayerTap(target, [0, 2])
    with torch.no_grad(), tap:
        with tap:
            target(ids)
            inner = tap.features()
        target(ids)
        torch.testing.assert_close(tap.features(), inner)  # the hooks outlived the inner block
    target(ids)
    with pytest.raises(RuntimeError, match="No hidden states captured"):
        tap.features()  # ... and left with the outer one


def test_stop_strings_cut_where_plain_decoding_stops():
    """A stop string completed inside an accepted draft ends generation at the same token as plain decoding."""
    tokenizer = char_tokenizer()
    target = make_bigram_like(tiny_target("qwen3", vocab_size=96, eos_token_id=2))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=7, markov_rank=96), target)
    stopped = 0
    for ids in prompts(96, count=25, seed=11):
        # Stop at the bigram of the first two tokens plain decoding produces after a warm-up, so it really occurs.
        free = target.generate(ids, max_new_tokens=30, do_sample=False)
        stop = tokenizer.decode(free[0, ids.shape[1] + 3: ids.shape[1] + 5])
        kwargs = dict(max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
        reference = target.generate(ids, **kwargs)
        out = target.generate(ids, assistant_model=drafter, **kwargs)
        assert torch.equal(out, reference), (stop, ids.tolist())
        stopped += reference.shape[1] < free.shape[1]
    assert stopped > 10  # the stop strings did end most generations early
