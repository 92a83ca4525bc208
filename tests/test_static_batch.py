"""`static_generate_batch`: decoding a left-padded batch on static caches with a write position per row.
Greedy: every row equals its solo plain `generate()` (float32), plain (`drafter=None`) and DSpark, with a bigram-oracle
drafter (rows accept different numbers of drafts in one round) and a random one, rows of different lengths (shorter
than a round's γ + 1 too), eos in the middle of a round, and budgets that end mid-round; and each row's drafts equal
those of the drafter given the row's whole committed context at once. Sampling: per prompt, the rows follow the
target's exact distribution (chi-square), and a seed fixes the draw eager and compiled."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from test_batched_generate import left_padded, random_batches
from test_generation_sampling import ALPHA, NEW_TOKENS, PROMPT, chi_square_p_value, exact_distribution, oracle_drafter
from test_generation_sampling import VOCAB as SMALL_VOCAB
from test_static_loop import counting_backend
from tiny_models import install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_gemma4_target, tiny_target
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import DynamicCache

from dspark_hf.generation.static_batch import RowStaticCache, StaticBatchRounds, static_generate_batch
from dspark_hf.models import TargetLayerTap

VOCAB_SIZE, EOS = 48, 2


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    return make_bigram_like(tiny_target(request.param, vocab_size=VOCAB_SIZE, eos_token_id=EOS))


def solo(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_rows_equal_solo(target, drafter, prompts, max_new_tokens, max_batch_size=None):
    ids, mask = left_padded(prompts)
    rows = static_generate_batch(target, drafter, ids, mask, max_new_tokens, max_batch_size=max_batch_size)
    for prompt, row in zip(prompts, rows):
        assert row == solo(target, prompt, max_new_tokens), prompt


@pytest.mark.parametrize("max_new_tokens", [1, 9, 30])
def test_rows_equal_solo_generate(target, max_new_tokens):
    oracle = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=VOCAB_SIZE), target)
    for prompts in random_batches(VOCAB_SIZE, count=2, size=5, seed=max_new_tokens):
        for max_batch_size in (None, 2):  # 2: three prompts take the rows of finished ones
            assert_rows_equal_solo(target, None, prompts, max_new_tokens, max_batch_size)
            assert_rows_equal_solo(target, oracle, prompts, max_new_tokens, max_batch_size)
            assert_rows_equal_solo(target, tiny_drafter(target, block_size=5, seed=3), prompts, max_new_tokens,
                                   max_batch_size)


def test_rows_accept_different_numbers_of_drafts_in_one_round(target):
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=VOCAB_SIZE), target, scale=3.0)
    prompts = random_batches(VOCAB_SIZE, count=1, size=6, seed=2)[0]
    ids, mask = left_padded(prompts)
    rounds = StaticBatchRounds(target, drafter, len(prompts), capacity=ids.shape[1] + 64)
    rounds.prefill(ids, mask)
    accepted = []
    with torch.no_grad(), rounds.tap:
        for _ in range(6):
            rounds.step()
            accepted.append(rounds.record[:, 0].tolist())
    assert any(len(set(round_)) > 1 for round_ in accepted)  # per-row write positions really differ
    assert max(max(round_) for round_ in accepted) > 0
    assert_rows_equal_solo(target, drafter, prompts, 25)


def reference_drafts(target, drafter, sequence: list[int], anchor: int, start: int = 0) -> list[int]:
    """The drafts after `anchor` from a drafter given the target features of `sequence` (the committed tokens before
    the anchor) from position `start` on, at once, on a fresh cache."""
    tap = TargetLayerTap(target, drafter.config.target_layer_ids)
    with torch.no_grad(), tap:
        target(input_ids=torch.tensor([sequence]))
        features = tap.features()
    length, block = len(sequence), drafter.config.block_size
    proposal = drafter.draft(torch.tensor([anchor]), features[:, start:], DynamicCache(),
                             position_ids=torch.arange(length, length + block)[None],
                             context_position_ids=torch.arange(start, length)[None])
    return proposal.tokens[0].tolist()


def assert_drafter_cache_holds_context(rounds: StaticBatchRounds, row: int, ids: list[int]) -> None:
    """Row `row`'s drafter-cache columns before its `context_column` hold exactly the K/V that a drafter forward over
    the target features of `ids` (the row's committed tokens) writes on a fresh cache: finer than comparing drafts,
    which a small error in a few columns need not change."""
    pad, written = int(rounds.pad[row]), int(rounds.context_column[row])
    if written <= pad:  # a short prompt's context starts inside its padding: nothing is written yet
        return
    tap = TargetLayerTap(rounds.target, rounds.drafter.config.target_layer_ids)
    with torch.no_grad(), tap:
        rounds.target(input_ids=torch.tensor([ids[: written - pad]]))
        features = tap.features()
    cache, count = DynamicCache(), written - pad
    with torch.no_grad():
        rounds.drafter(input_ids=torch.tensor([[rounds.drafter.config.mask_token_id]]), target_hidden_states=features,
                       past_key_values=cache, context_position_ids=torch.arange(count)[None],
                       position_ids=torch.tensor([[count]]))
    for layer, fresh in zip(rounds.drafter_cache.layers, cache.layers):
        assert torch.allclose(layer.keys[row, :, pad:written], fresh.keys[0], atol=1e-5)
        assert torch.allclose(layer.values[row, :, pad:written], fresh.values[0], atol=1e-5)


def test_each_row_drafts_from_exactly_its_committed_context(target):
    """Output equality cannot see the drafter's context (drafts change only what is accepted): a random drafter,
    whose drafts depend on every context feature, must propose what it proposes given the row's whole context."""
    drafter = tiny_drafter(target, block_size=5, seed=3)
    oracle = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=VOCAB_SIZE), target, scale=3.0)
    prompts = random_batches(VOCAB_SIZE, count=1, size=4, seed=8)[0]
    ids, mask = left_padded(prompts)
    for model in (drafter, oracle):  # the oracle accepts some drafts: write positions move apart
        rounds = StaticBatchRounds(target, model, len(prompts), capacity=ids.shape[1] + 64)
        rounds.prefill(ids, mask)
        committed = [[token] for token in rounds.record[:, 1].tolist()]
        for _ in range(5):
            contexts = [prompt + row[:-1] for prompt, row in zip(prompts, committed)]
            with torch.no_grad(), rounds.tap:
                rounds.step()
            for row, (accepted, *tokens) in enumerate(rounds.record.tolist()):
                assert rounds.drafts[row].tolist() == reference_drafts(target, model, contexts[row],
                                                                       committed[row][-1])
                committed[row] += tokens[: accepted + 1]


@pytest.mark.parametrize("window", [None, 14], ids=["window_gamma_plus_1", "window_14"])
def test_rounds_of_any_width_and_plain_rounds_keep_the_drafter_context_whole(target, window):
    """`DSparkEngine(static=True)`'s rounds: each verifies v in 0..γ drafts of every row (v = 0, a plain round, puts
    its target features in the drafter's pending context, γ + 1 or 14 of them; `flush()` writes it into the drafter
    cache when `must_flush` says so). In a random order of them, every drafting round proposes the first v of what the
    drafter proposes given each row's whole committed context, running only those v slots through the drafter's LM
    head (and so its Markov loop), every row's drafter cache holds exactly that context's K/V, and the rows commit
    their solo greedy tokens."""
    import random

    rng = random.Random(4)
    random_drafter = tiny_drafter(target, block_size=5, seed=3)
    oracle = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=VOCAB_SIZE), target, scale=3.0)
    prompts = random_batches(VOCAB_SIZE, count=1, size=4, seed=9)[0]
    ids, mask = left_padded(prompts)
    for model in (random_drafter, oracle):
        head_slots, compute_logits = [], model.compute_logits
        model.compute_logits = lambda hidden, _logits=compute_logits: head_slots.append(hidden.shape[1]) or \
            _logits(hidden)
        rounds = StaticBatchRounds(target, model, len(prompts), capacity=ids.shape[1] + 96, context_window=window)
        rounds.prefill(ids, mask)
        span = rounds.width
        committed = [[token] for token in rounds.record[:, 1].tolist()]
        pending = [span] * len(prompts)  # a prefill leaves its last γ + 1 features pending
        widths, flushes = [], 0
        while min(map(len, committed)) < 40:
            verify = rng.choice([0, 0, 0, 1, 3, span - 1])
            contexts = [prompt + row[:-1] for prompt, row in zip(prompts, committed)]
            with torch.no_grad(), rounds.tap:
                if rounds.must_flush(verify, max(pending)):
                    rounds.flush()
                    pending, flushes = [0] * len(prompts), flushes + 1
                head_slots.clear()
                rounds.greedy_round(verify)()
            assert head_slots == ([verify] if verify > 0 else [])
            for row, (accepted, *tokens) in enumerate(rounds.record.tolist()):
                if verify > 0:
                    expected = reference_drafts(target, model, contexts[row], committed[row][-1])
                    assert len(expected) == span - 1
                    assert rounds.drafts[row, :verify].tolist() == expected[:verify]
                assert accepted <= verify
                committed[row] += tokens[: accepted + 1]
                pending[row] = pending[row] + 1 if verify == 0 else accepted + 1
                assert_drafter_cache_holds_context(rounds, row, prompts[row] + committed[row])
            widths.append(verify)
        assert flushes > 0 and {0, 1, 3, span - 1} <= set(widths)
        for prompt, row in zip(prompts, committed):
            assert row[:40] == solo(target, prompt, 40)
        del model.compute_logits


def test_an_admitted_row_drafts_from_exactly_its_committed_context(target):
    """A prompt admitted into a finished row of a running batch (`admit`: its own prefill, written into that row's
    columns) leaves that row as prefilling it alone would (caches, features, positions), and drafts, round after
    round, what the drafter proposes given its whole committed context at once; the row that kept running is
    undisturbed."""
    drafter = tiny_drafter(target, block_size=5, seed=3)
    prompts = [[5, 9, 11, 4, 30, 8, 7], [6, 13, 21, 17, 9, 40, 41, 42, 43]]
    ids, mask = left_padded(prompts)
    rounds = StaticBatchRounds(target, drafter, 2, capacity=ids.shape[1] + 40)
    rounds.prefill(ids, mask)
    committed = [[token] for token in rounds.record[:, 1].tolist()]
    with torch.no_grad(), rounds.tap:
        for _ in range(3):
            rounds.step()
            for row, (accepted, *tokens) in enumerate(rounds.record.tolist()):
                committed[row] += tokens[: accepted + 1]
    rounds.active[0] = 0  # row 0 finishes; a new, longer prompt takes its row
    prompts[0] = [7, 3, 22, 19, 4, 5, 31, 30, 29, 8, 12]
    with torch.no_grad():
        rounds.admit([0], torch.tensor([prompts[0]]), torch.ones(1, len(prompts[0]), dtype=torch.long))
    committed[0] = [int(rounds.record[0, 1])]
    assert committed[0] == solo(target, prompts[0], 1)
    fresh = StaticBatchRounds(target, drafter, 1, capacity=rounds.capacity)  # the same prompt prefilled alone
    fresh.prefill(torch.tensor([prompts[0]]), torch.ones(1, len(prompts[0]), dtype=torch.long))
    for name in ("pad", "anchor", "column", "context_column", "active"):
        assert getattr(rounds, name)[0] == getattr(fresh, name)[0], name
    assert torch.allclose(rounds.features[0], fresh.features[0], atol=1e-6)
    for cache, fresh_cache, columns in ((rounds.target_cache, fresh.target_cache, len(prompts[0])),
                                        (rounds.drafter_cache, fresh.drafter_cache, int(fresh.context_column[0]))):
        for layer, fresh_layer in zip(cache.layers, fresh_cache.layers):
            assert torch.allclose(layer.keys[0, :, :columns], fresh_layer.keys[0, :, :columns], atol=1e-6)
            assert torch.allclose(layer.values[0, :, :columns], fresh_layer.values[0, :, :columns], atol=1e-6)
    for _ in range(4):
        contexts = [prompt + row[:-1] for prompt, row in zip(prompts, committed)]
        with torch.no_grad(), rounds.tap:
            rounds.step()
        for row, (accepted, *tokens) in enumerate(rounds.record.tolist()):
            assert rounds.drafts[row].tolist() == reference_drafts(target, drafter, contexts[row], committed[row][-1])
            committed[row] += tokens[: accepted + 1]
    for prompt, row in zip(prompts, committed):
        assert row == solo(target, prompt, len(row))


def test_eos_ends_each_row_where_plain_decoding_does():
    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=VOCAB_SIZE), target)
    prompts = [[9, 11, last] for last in range(4, 16)]  # a bigram target continues from the last token
    continuations = [solo(target, prompt, 30) for prompt in prompts]
    # an eos that ends some rows after a few tokens (inside a round) and not others
    eos = next(token for token in range(3, VOCAB_SIZE)
               if any(token in row[2:] and token not in row[:2] for row in continuations)
               and any(token not in row for row in continuations))
    ids, mask = left_padded(prompts)
    rows = static_generate_batch(target, drafter, ids, mask, 30, eos_token_id=eos)
    assert static_generate_batch(target, drafter, ids, mask, 30, eos_token_id=eos, max_batch_size=4) == rows
    ended = 0
    for prompt, row in zip(prompts, rows):
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                                   eos_token_id=eos)[0, len(prompt):].tolist()
        if eos in expected:
            expected = expected[: expected.index(eos) + 1]
            ended += 1
        assert row == expected
    assert 0 < ended < len(prompts)


@pytest.mark.parametrize("with_drafter", [True, False], ids=["dspark", "plain"])
def test_compiled_round_is_one_graph_with_the_same_rows(target, with_drafter):
    """fullgraph=True: drafter, Markov loop, target forward, acceptance and the per-row bookkeeping trace without a
    graph break, once for two whole generations of 4 and 3 rows (the batch is padded to a power of two: one shape,
    what CUDA-graph capture needs)."""
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=VOCAB_SIZE), target, scale=3.0)
    drafter = drafter if with_drafter else None
    compilations, backend = counting_backend()
    torch._dynamo.reset()
    prompts = random_batches(VOCAB_SIZE, count=1, size=4, seed=4)[0]
    ids, mask = left_padded(prompts)
    options = dict(backend=backend, fullgraph=True, dynamic=False)
    rows = static_generate_batch(target, drafter, ids, mask, 20, compile=options)
    assert rows == [solo(target, prompt, 20) for prompt in prompts]
    kept = StaticBatchRounds.for_models(target, drafter, len(prompts), 1, options)
    # a second call with three other prompts: padded to the same batch of 4, the kept round, no recompilation
    other = [prompt[::-1] + [5] for prompt in prompts[:3]]
    ids, mask = left_padded(other)
    assert static_generate_batch(target, drafter, ids, mask, 12, compile=options) == [solo(target, p, 12)
                                                                                       for p in other]
    assert StaticBatchRounds.for_models(target, drafter, len(prompts), 1, options) is kept
    assert len(compilations) == 1


def test_inductor_keeps_each_rows_state_consistent():
    """Compiled by inductor, every row accepts what it accepts eagerly, and its drafter context starts where the
    last round's anchor stood (see test_static_loop's inductor test for the copy-after-update it once made). One
    target family: inductor compiles for ~30 s."""
    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=VOCAB_SIZE), target, scale=3.0)
    prompts = random_batches(VOCAB_SIZE, count=1, size=3, seed=6)[0]
    ids, mask = left_padded(prompts)
    eager = static_generate_batch(target, drafter, ids, mask, 16, eos_token_id=[])
    accepted = [row.accepted for row in drafter.generation_stats.rows]
    torch._dynamo.reset()
    options = dict(backend="inductor", fullgraph=True, dynamic=False)
    assert static_generate_batch(target, drafter, ids, mask, 16, eos_token_id=[], compile=options) == eager
    assert [row.accepted for row in drafter.generation_stats.rows] == accepted
    rounds = StaticBatchRounds._kept[drafter]  # (a batch of 4: the 3 rows and a spare one)
    last = rounds.record[:, 0] + 1
    moved = (rounds.column - rounds.context_column).tolist()
    assert all(m in (0, n) for m, n in zip(moved, last.tolist()))
    assert any(moved)


SECOND_PROMPT = [2, 3, 0, 5, 1]  # longer: the rows of PROMPT are left-padded


@pytest.mark.parametrize("with_drafter,max_batch_size", [(True, None), (False, None), (True, 1024)],
                         ids=["dspark", "plain", "dspark-refilled"])
def test_sampling_follows_each_rows_target_distribution(with_drafter, max_batch_size):
    """2500 rows of each of two prompts in one batch, or 1024 at a time with the others admitted as rows finish
    (temperature 0.7, top-p 0.8): per prompt, the rows' first three
    tokens pass the chi-square test against the exactly enumerated distribution (see test_generation_sampling.py for
    the protocol and the stated false-alarm rate of 0.1 %). Negative control: the same rows fail the test against
    the distribution at a temperature 15 % higher."""
    target = make_bigram_like(tiny_target("qwen3", vocab_size=SMALL_VOCAB, eos_token_id=None), damping=0.3)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    drafter = oracle_drafter(target, scale=3.0) if with_drafter else None
    prompts, num_samples = (PROMPT[0].tolist(), SECOND_PROMPT), 2500
    ids, mask = left_padded([prompt for prompt in prompts for _ in range(num_samples)])
    rows = static_generate_batch(target, drafter, ids, mask, NEW_TOKENS, do_sample=True, temperature=0.7, top_p=0.8,
                                 seed=0, max_batch_size=max_batch_size)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.8)])
    hotter = LogitsProcessorList([TemperatureLogitsWarper(0.7 * 1.15), TopPLogitsWarper(0.8)])
    for index, prompt in enumerate(prompts):
        counts = Counter(tuple(row) for row in rows[index * num_samples: (index + 1) * num_samples])
        assert chi_square_p_value(counts, exact_distribution(target, processors, prompt), num_samples) > ALPHA
        assert chi_square_p_value(counts, exact_distribution(target, hotter, prompt), num_samples) < ALPHA
    if with_drafter:
        assert drafter.generation_stats.tau > 1.2  # drafts were accepted: the verification, not only the bonus, ran


def test_sampling_is_fixed_by_the_seed_eager_and_compiled(target):
    drafter = tiny_drafter(target, block_size=5, seed=3)
    prompts = random_batches(VOCAB_SIZE, count=1, size=3, seed=1)[0]
    ids, mask = left_padded(prompts)
    compilations, backend = counting_backend()
    torch._dynamo.reset()
    options = dict(backend=backend, fullgraph=True, dynamic=False)
    draws = {compile is not False: [static_generate_batch(target, drafter, ids, mask, 12, do_sample=True, top_k=20,
                                                          temperature=0.8, seed=seed, compile=compile)
                                    for seed in range(3)]
             for compile in (False, options)}
    assert draws[False] == draws[True] and draws[False][0] != draws[False][1]
    assert len(compilations) == 1


def test_row_cache_writes_each_row_at_its_own_column():
    cache = RowStaticCache(num_layers=1, capacity=6, batch_size=2, device=torch.device("cpu"))
    cache.move_to(torch.tensor([1, 3]))
    states = torch.arange(2 * 1 * 2 * 1, dtype=torch.float32).reshape(2, 1, 2, 1) + 1
    keys, _ = cache.update(states, states, 0)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 0, 0, 0] and keys[1, 0, :, 0].tolist() == [0, 0, 0, 3, 4, 0]
    assert cache.layers[0].cumulative_length.tolist() == [3, 5]


def test_bad_calls_are_refused(target):
    with pytest.raises(ValueError, match="max_new_tokens"):
        static_generate_batch(target, None, torch.tensor([[5, 6]]), None, 0)
    with pytest.raises(ValueError, match="one prompt token"):
        static_generate_batch(target, None, torch.tensor([[5, 6]]), torch.tensor([[0, 0]]), 4)
    with pytest.raises(ValueError, match="full-attention"):
        static_generate_batch(tiny_gemma4_target(), None, torch.tensor([[5, 6]]), None, 4)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        static_generate_batch(target, None, torch.tensor([[5, 6]]), None, 4, do_sample=True, temperature=0)
    meta = tiny_drafter(target, block_size=5, seed=3).to("meta")  # any device other than the target's
    with pytest.raises(ValueError, match="one device"):
        static_generate_batch(target, meta, torch.tensor([[5, 6]]), None, 4)


def test_batched_generate_with_a_static_cache_runs_the_batch_fast_path(monkeypatch):
    """`generate(assistant_model=drafter, cache_implementation="static")` at batch > 1 decodes every left-padded row
    with `static_generate_batch`, exactly as plain greedy decoding (rows padded after their eos as plain batched
    generate() pads them), and passes it the call's sampling settings; what the fast path cannot do is refused."""
    from dspark_hf.generation import static_batch

    calls = []
    original = static_batch.static_generate_batch
    monkeypatch.setattr(static_batch, "static_generate_batch",
                        lambda *args, **kwargs: calls.append(kwargs) or original(*args, **kwargs))
    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=VOCAB_SIZE), target)
    prompts = [[9, 11, last] for last in range(4, 16)] + [[5, 30, 7, 12, 8, 21, 40]]
    continuations = [solo(target, prompt, 30) for prompt in prompts]
    eos = next(token for token in range(3, VOCAB_SIZE)  # one that ends some rows early and not others
               if any(token in row[2:] and token not in row[:2] for row in continuations)
               and any(token not in row for row in continuations))
    ids, mask = left_padded(prompts)
    stops = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=1)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, cache_implementation="static", **stops)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **stops))
    ended = (out[:, ids.shape[1]:] == eos).any(dim=1)
    assert 0 < int(ended.sum()) < len(prompts) and (out == 1).any() and len(calls) == 1
    torch.manual_seed(0)
    target.generate(ids, attention_mask=mask, assistant_model=drafter, cache_implementation="static",
                    max_new_tokens=8, do_sample=True, temperature=0.7, top_k=9)
    assert {k: calls[-1][k] for k in ("do_sample", "temperature", "top_k", "eos_token_id", "compile")} == dict(
        do_sample=True, temperature=pytest.approx(0.7), top_k=9, eos_token_id=[EOS], compile=False)
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, cache_implementation="static",
                        max_new_tokens=8, repetition_penalty=1.2)


def test_replayed_acceptance_sets_each_rows_accepted_drafts(target):
    """Timing only: with `replay_acceptance()`, a greedy drafting round of width v accepts min(count, v) drafts per row,
    whatever the drafts, and moves each row by that count + 1 (a row prefix reads the same buffer); it must be set up
    before the first round."""
    drafter = tiny_drafter(target, block_size=5, seed=3)
    prompts = random_batches(VOCAB_SIZE, count=1, size=4, seed=5)[0]
    ids, mask = left_padded(prompts)
    rounds = StaticBatchRounds(target, drafter, len(prompts), capacity=ids.shape[1] + 64)
    rounds.prefill(ids, mask)
    counts = rounds.replay_acceptance()
    with torch.no_grad(), rounds.tap:
        for width, replayed, wanted in ((4, [0, 2, 4, 9], [0, 2, 4, 4]), (2, [1, 0, 2, 3], [1, 0, 2, 2]),
                                        (4, [3, 1, 0, 4], [3, 1, 0, 4])):
            counts.copy_(torch.tensor(replayed))
            columns = rounds.column.clone()
            rounds.greedy_round(width)()
            assert rounds.record[:, 0].tolist() == wanted
            assert (rounds.column - columns).tolist() == [count + 1 for count in wanted]
        counts.copy_(torch.tensor([1, 1, 3, 0]))
        half = rounds.prefix(2)
        half.greedy_round(4)()
    assert half.record[:, 0].tolist() == [1, 1] and half.replayed_acceptance.data_ptr() == counts.data_ptr()
    with pytest.raises(RuntimeError, match="before any round"):
        rounds.replay_acceptance()


def test_compiled_rounds_write_caches_and_features_in_place():
    """Inductor writes a round's new K/V and features where they go and nowhere else: with `scatter_` into the caches
    the compiled rounds copied whole caches (loops over all their elements) for every layer and round, on the H200 60 %
    of a Qwen3-4B-shaped round's GPU time at 256 rows (`results/plain_round_tax_h200.json`); torch 2.11 also copied
    them (into buffers of their transposed shape) for `index_put_` into a transposed view. The compiled rounds commit
    what the eager ones do."""
    from torch._inductor.utils import run_and_get_code

    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    drafter = tiny_drafter(target, block_size=5, seed=3)
    ids, mask = left_padded(random_batches(VOCAB_SIZE, count=1, size=4, seed=5)[0])
    compiled, eager = (StaticBatchRounds(target, drafter, 4, capacity=1537, compile=compile, context_window=24)
                       for compile in (dict(dynamic=False), False))
    torch._dynamo.reset()
    with torch.no_grad():  # (inductor hands run_and_get_code the graph's code on a cache hit too)
        for rounds in (compiled, eager):
            rounds.prefill(ids, mask)
        buffers = (compiled.target_cache.layers[0].keys, compiled.drafter_cache.layers[0].keys, compiled.features)
        for call in (lambda rounds: rounds.greedy_round(0)(), lambda rounds: rounds.greedy_round(3)(),
                     lambda rounds: rounds.flush()):
            with compiled.tap:
                _, code = run_and_get_code(call, compiled)
            with eager.tap:
                call(eager)
            code = "\n".join(code)
            assert not any(f"{buffer.numel()}L" in code for buffer in buffers)  # no whole-buffer loop ...
            allocated = [sorted(int(size) for size in shape.split(",") if size.strip())
                         for shape in re.findall(r"empty_strided_\w+\(\(([\d, ]+)\)", code)]
            assert not any(sorted(buffer.shape) in allocated for buffer in buffers)  # ... nor a copy in any layout
            assert torch.equal(compiled.record, eager.record) and torch.equal(compiled.column, eager.column)


def test_a_bare_plain_round_runs_exactly_what_plain_decoding_without_a_drafter_runs(target):
    """A drafter's bare plain round (`greedy_round(0, bare=True)`) runs the same aten operators, in the same order, as
    a plain round of rounds without a drafter (counted by torch.profiler, eager on the CPU), and commits the same
    tokens; the drafter's plain round that keeps its features runs more (the tap's concatenation and the append to
    the pending context)."""
    drafter = tiny_drafter(target, block_size=5, seed=3)
    prompts = [[5, 9, 11, 4, 30, 8, 7, 9, 10, 11, 12], [6, 13, 21, 17, 9, 40, 41, 42, 43, 44, 45]]
    ids, mask = left_padded(prompts)

    def operators(model, bare: bool) -> tuple[list[str], list[int]]:
        rounds = StaticBatchRounds(target, model, 2, capacity=ids.shape[1] + 16, context_window=12)
        with torch.no_grad():
            rounds.prefill(ids, mask)
            round_ = rounds.greedy_round(0, bare)
            round_()  # (lazy set-up outside the count)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                round_()
        names = [event.name for event in profile.events() if event.name.startswith("aten::")]
        return names, rounds.record[:, 1].tolist()

    plain, plain_tokens = operators(None, bare=False)
    bare, bare_tokens = operators(drafter, bare=True)
    with_features, _ = operators(drafter, bare=False)
    assert bare == plain and bare_tokens == plain_tokens
    assert with_features.count("aten::cat") > plain.count("aten::cat")
    assert with_features.count("aten::index_put_") > plain.count("aten::index_put_")
