"""`static_generate`: batch-1 decoding on static KV caches with position rollback, DSpark and plain (`drafter=None`).
Greedy output equals plain `generate()` (float32) with good and bad drafters, eos inside a round, budgets that end
mid-round, and the round (drafter + target + acceptance) traced by torch.compile as one graph; sampling follows the
target's exact distribution (chi-square, see test_generation_sampling.py for the protocol and the stated false-alarm
rate) and draws the same tokens eager and compiled."""

from __future__ import annotations

import pytest
import torch
from test_generation_sampling import ALPHA, NEW_TOKENS, PROMPT, chi_square_p_value, exact_distribution, oracle_drafter
from tiny_models import install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_gemma4_target, tiny_target
from transformers import LogitsProcessorList, StaticCache, TemperatureLogitsWarper, TopPLogitsWarper
from transformers.generation.streamers import BaseStreamer

import dspark_hf  # noqa: F401
from dspark_hf.generation import static_generate
from dspark_hf.generation.fused_projections import FusedLinear
from dspark_hf.generation import static_loop
from dspark_hf.generation.static_loop import StaticRound, StaticVerifier
from dspark_hf.models import TargetLayerTap

VOCAB_SIZE, EOS = 48, 2


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    return make_bigram_like(tiny_target(request.param, vocab_size=VOCAB_SIZE, eos_token_id=EOS))


def drafters(target):
    good = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=VOCAB_SIZE), target)
    return {"good": good, "random": tiny_drafter(target, block_size=5, seed=3)}


def plain(target, prompt, max_new_tokens, **kwargs):
    return target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


@pytest.mark.parametrize("prompt", [[7], [5, 9, 11, 4, 30, 8], list(range(4, 24))])
@pytest.mark.parametrize("max_new_tokens", [1, 13, 40])
def test_greedy_equals_plain_generate(target, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    expected = plain(target, ids, max_new_tokens)
    candidates = drafters(target)
    assert torch.equal(static_generate(target, None, ids, max_new_tokens), expected)  # plain, on the static cache
    for name, drafter in candidates.items():
        assert torch.equal(static_generate(target, drafter, ids, max_new_tokens), expected), name
        stats = drafter.generation_stats
        assert 1 + sum(stats.committed) >= max_new_tokens and set(stats.drafted) <= {drafter.config.num_draft_slots}
        assert all(c == a + 1 for a, c in zip(stats.accepted, stats.committed))
    assert candidates["good"].generation_stats.tau > 1 or max_new_tokens == 1


def test_eos_inside_a_round_ends_where_plain_decoding_does(target):
    for first in range(4, VOCAB_SIZE):  # a prompt whose continuation meets a new token after its first
        ids = torch.tensor([[first, 9, 11]])
        continuation = plain(target, ids, 30)[0, 3:].tolist()
        index = next((i for i in range(1, 30) if continuation[i] not in continuation[:i]), None)
        if index is not None:
            break
    stop = continuation[index]  # made the eos: plain decoding ends there, inside one of our rounds
    expected = plain(target, ids, 30, eos_token_id=stop)
    assert expected.shape[1] == 3 + index + 1
    assert torch.equal(static_generate(target, None, ids, 30, eos_token_id=stop), expected)
    for name, drafter in drafters(target).items():
        assert torch.equal(static_generate(target, drafter, ids, 30, eos_token_id=stop), expected), name


def counting_backend():
    """A torch.compile backend that runs the traced graph as it is and records each compilation."""
    compilations = []

    def backend(graph, example_inputs):
        compilations.append(graph)
        return graph.forward

    return compilations, backend


@pytest.mark.parametrize("with_drafter", [True, False], ids=["dspark", "plain"])
def test_compiled_round_is_one_graph_with_the_same_tokens(target, with_drafter, monkeypatch):
    """fullgraph=True: drafter, Markov loop, target forward and acceptance trace without a graph break; two backend
    calls over three whole generations (the round and the prefill chunk): one shape each, no recompilation (what
    CUDA-graph capture needs). After a prompt of at least γ + 1 tokens even the first round runs compiled: the
    prefill chunks have written the drafter's context (the very first chunk runs eagerly, so the drafter's first
    forward is not traced)."""
    good = drafters(target)["good"] if with_drafter else None
    compilations, backend = counting_backend()
    torch._dynamo.reset()
    options = dict(backend=backend, fullgraph=True, dynamic=False)
    eager_rounds, round_function = [], StaticRound.greedy_round

    def counted(self, *args):
        if not torch.compiler.is_compiling():  # a round run eagerly, not one traced into the graph
            eager_rounds.append(args)
        return round_function(self, *args)

    monkeypatch.setattr(StaticRound, "greedy_round", counted)
    # γ + 1 prompt tokens first; then 12 (within the caches' length: 14 new tokens), then 3, fewer than γ + 1, whose
    # first round runs eagerly over the whole prompt
    width = good.config.num_draft_slots + 1 if with_drafter else 6
    for ids, new_tokens, eager_first in ((torch.tensor([list(range(30, 30 + width))]), 20, 0),
                                         (torch.tensor([list(range(4, 16))]), 14, 0),
                                         (torch.tensor([[5, 9, 11]]), 20, 1)):
        eager_rounds.clear()
        compiled = static_generate(target, good, ids, new_tokens, compile=options)
        assert torch.equal(compiled, plain(target, ids, new_tokens))
        if with_drafter:
            assert good.generation_stats.rounds > 2 and len(eager_rounds) == eager_first
    assert len(compilations) == 2


@pytest.mark.parametrize("with_drafter", [True, False], ids=["dspark", "plain"])
def test_sampling_draws_the_same_tokens_eager_and_compiled(target, with_drafter):
    """The noise is drawn outside the round, so a seed fixes the output whether or not the round is compiled."""
    drafter = drafters(target)["random"] if with_drafter else None
    compilations, backend = counting_backend()
    torch._dynamo.reset()
    options = dict(backend=backend, fullgraph=True, dynamic=False)
    outputs = {compile is not False: [static_generate(target, drafter, ids, 12, do_sample=True, temperature=0.8,
                                                      top_k=20, seed=seed, compile=compile)
                                      for ids in (torch.tensor([list(range(4, 16))]), torch.tensor([[5, 9, 11]]))
                                      for seed in range(4)]
               for compile in (False, options)}
    assert all(torch.equal(a, b) for a, b in zip(outputs[False], outputs[True]))
    assert len({tuple(out[0].tolist()) for out in outputs[False]}) > 1  # the seeds do change the draw
    assert len(compilations) == 2  # the round and the prefill chunk


def test_features_come_from_the_tap_so_a_drafter_may_tap_the_last_layer(target):
    """The raw output of the last decoder layer (transformers' `output_hidden_states` gives it after the final norm),
    eager and traced into one compiled graph."""
    last = target.config.num_hidden_layers - 1
    drafter = tiny_drafter(target, block_size=5, seed=3, target_layer_ids=(0, last))
    ids = torch.tensor([[5, 9, 11, 4]])
    verifier = StaticVerifier(target, [0, last], 16)
    _, features = verifier.prefill(ids)
    with TargetLayerTap(target, [0, last]) as tap:
        target(ids)
        expected = tap.features()
    torch.testing.assert_close(features, expected)
    assert not torch.allclose(features[..., -target.config.hidden_size:],
                              target(ids, output_hidden_states=True).hidden_states[-1])  # not the normed state
    compilations, backend = counting_backend()
    torch._dynamo.reset()
    options = dict(backend=backend, fullgraph=True)
    for compile in (False, options):
        assert torch.equal(static_generate(target, drafter, ids, 30, compile=compile), plain(target, ids, 30))
    assert len(compilations) == 2  # the prefill chunk and the round


def prompt_of(length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (1, length), generator=torch.Generator().manual_seed(length))


@pytest.mark.parametrize("length", [3, 6, 64, 150])
def test_a_chunked_prefill_fills_the_caches_as_one_forward_does(target, length):
    """Compiled, a prompt is prefilled by `PREFILL_CHUNK`-token forwards (chunks every 64 positions, the last ending
    at the prompt's end; a short prompt padded past it), each replaying one graph. The last logits, the first round's
    features and where they start, and every prompt row of the caches equal one eager forward's (the target's rows,
    the drafter's context rows that the first round does not rewrite), in the first call (first chunk eager) and the
    next (all chunks traced)."""
    drafter = drafters(target)["random"]
    width = drafter.config.num_draft_slots + 1
    ids = prompt_of(length)
    compilations, backend = counting_backend()
    torch._dynamo.reset()
    options = dict(backend=backend, fullgraph=True, dynamic=False)
    eager, chunked = (StaticRound(target, drafter, 256, compile, do_sample=False) for compile in (False, options))
    expected = eager.prefill(ids)
    assert expected.compiled_first == (length > width)  # (one eager forward: the drafter's first forward runs alone)
    for _ in range(2):
        got = chunked.prefill(ids)
        assert got.compiled_first == (length >= width)
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
        if expected.compiled_first:
            torch.testing.assert_close(got.features, expected.features, rtol=1e-5, atol=1e-5)
            assert int(got.context_start) == int(expected.context_start) == length - width
        for ours, theirs, rows in ((chunked.verifier.cache, eager.verifier.cache, length),
                                   (chunked.drafter_cache, eager.drafter_cache, length - width)):
            for a, b in zip(ours.layers, theirs.layers):
                if rows > 0:
                    torch.testing.assert_close(a.keys[:, :, :rows], b.keys[:, :, :rows], rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(a.values[:, :, :rows], b.values[:, :, :rows], rtol=1e-5, atol=1e-5)
    assert len(compilations) == 1  # one chunk shape, whatever the prompt's length


@pytest.mark.parametrize("with_drafter", [True, False], ids=["dspark", "plain"])
def test_long_prompts_prefill_in_chunks_or_in_one_eager_forward_with_plain_tokens(target, with_drafter, monkeypatch):
    """Compiled greedy decoding after a 150-token prompt (three chunks) gives plain `generate()`'s tokens; with
    `MAX_PREFILL_CHUNKS` 2 the same prompt prefills in one eager forward instead, with the same tokens."""
    drafter = drafters(target)["good"] if with_drafter else None
    ids = prompt_of(150)
    expected = plain(target, ids, 20)
    eager_prefills, prefill = [], StaticVerifier.prefill
    monkeypatch.setattr(StaticVerifier, "prefill", lambda self, ids: eager_prefills.append(ids) or prefill(self, ids))
    compilations, backend = counting_backend()
    torch._dynamo.reset()
    options = dict(backend=backend, fullgraph=True, dynamic=False)
    for chunks, eager in ((8, 0), (2, 1)):
        monkeypatch.setattr(static_loop, "MAX_PREFILL_CHUNKS", chunks)
        eager_prefills.clear()
        assert torch.equal(static_generate(target, drafter, ids, 20, compile=options), expected)
        assert len(eager_prefills) == eager


def test_a_target_whose_static_cache_cannot_roll_back_is_refused():
    """Sliding-window layers keep a ring buffer: moving the write position back neither rolls rejected tokens back
    nor resets it for the next call (before this check, a Gemma4 target decoded other tokens than plain decoding)."""
    target = tiny_gemma4_target()
    assert "StaticSlidingWindowLayer" in {type(layer).__name__ for layer in StaticCache(config=target.config,
                                                                                         max_cache_len=32).layers}
    ids = torch.tensor([[5, 9, 11]])
    for drafter in (None, tiny_drafter(target, block_size=4, target_layer_ids=(0, 2))):
        with pytest.raises(ValueError, match="StaticSlidingWindowLayer"):
            static_generate(target, drafter, ids, 4, fuse_projections=True)
    assert not any(isinstance(m, FusedLinear) for m in target.modules())  # refused before touching the model
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer"):
        target.generate(ids, assistant_model=tiny_drafter(target, block_size=4, target_layer_ids=(0, 2)),
                        cache_implementation="static", max_new_tokens=4, do_sample=False)


def test_refusals(target):
    good = drafters(target)["good"]
    with pytest.raises(ValueError, match="one prompt"):
        static_generate(target, good, torch.tensor([[5, 6], [7, 8]]), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        static_generate(target, good, torch.tensor([[5, 6]]), 0)
    meta = tiny_drafter(target, block_size=5, seed=3).to("meta")  # any device other than the target's
    with pytest.raises(ValueError, match="one device"):
        static_generate(target, meta, torch.tensor([[5, 6]]), 4)
    with pytest.raises(ValueError, match="attention must be one of"):
        static_generate(target, good, torch.tensor([[5, 6]]), 4, attention="flash")


@pytest.fixture(scope="module")
def small_target():
    model = make_bigram_like(tiny_target("qwen3", vocab_size=6, eos_token_id=None), damping=0.3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    return model


T07_TOP_P08 = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.8)])


@pytest.mark.parametrize("with_drafter,sampling,processors", [
    (True, dict(temperature=0.7, top_p=0.8), T07_TOP_P08),
    (False, dict(temperature=0.7, top_p=0.8), T07_TOP_P08),
], ids=["dspark-t0.7-top_p0.8", "plain-t0.7-top_p0.8"])  # (t = 1 without top-p is the same code with no filter)
def test_sampling_matches_target_distribution(small_target, with_drafter, sampling, processors):
    drafter = oracle_drafter(small_target, scale=3.0) if with_drafter else None
    num_samples, counts = 2500, {}
    for index in range(num_samples):
        out = static_generate(small_target, drafter, PROMPT, NEW_TOKENS, do_sample=True, seed=index, **sampling)
        cell = tuple(out[0, PROMPT.shape[1]:].tolist())
        counts[cell] = counts.get(cell, 0) + 1
    assert chi_square_p_value(counts, exact_distribution(small_target, processors), num_samples) > ALPHA


def test_greedy_rounds_are_queued_with_fewer_host_reads_than_rounds(target, monkeypatch):
    """Greedy state stays on the device: with no eos to watch, plain decoding reads the device twice (the first
    token, then every queued step at once) and DSpark fewer times than it runs rounds."""
    reads = []
    for name in ("tolist", "__int__", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _f=original, _n=name: reads.append(_n) or _f(self))
    ids = torch.tensor([[5, 9, 11]])
    expected = plain(target, ids, 40, eos_token_id=None)
    monkeypatch.setattr(target.generation_config, "eos_token_id", None)
    reads.clear()
    assert torch.equal(static_generate(target, None, ids, 40), expected)
    assert len(reads) == 2
    drafter = drafters(target)["random"]  # about one token per round: many rounds
    reads.clear()
    assert torch.equal(static_generate(target, drafter, ids, 40), expected)
    rounds = drafter.generation_stats.rounds
    assert rounds > 10 and len(reads) < rounds / 2


def test_inductor_keeps_the_round_state_consistent():
    """After the last queued round the drafter's context starts where that round's anchor stood: position minus the
    tokens it committed. (Inductor once applied `context_start.copy_(position)` after updating `position`, which
    left the output intact but fed the drafter the wrong context.) One target family: inductor compiles for ~20 s."""
    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    drafter = drafters(target)["good"]
    torch._dynamo.reset()
    ids = torch.tensor([[5, 9, 11]])
    out = static_generate(target, drafter, ids, 24, eos_token_id=[],
                          compile=dict(backend="inductor", fullgraph=True, dynamic=False))
    assert torch.equal(out, plain(target, ids, 24, eos_token_id=None))
    rounds = StaticRound._kept[drafter]
    last = rounds.record[int(rounds.round_index) - 1]
    assert int(rounds.position - rounds.context_start) == int(last[0]) + 1
    assert int(rounds.position) == int(rounds.context_start) + drafter.generation_stats.committed[-1]


@pytest.fixture
def static_calls(monkeypatch):
    """Records the keyword arguments of every `static_generate` call that generate() makes."""
    from dspark_hf.generation import static_loop

    calls = []
    original = static_loop.static_generate

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(static_loop, "static_generate", recording)
    return calls


def test_generate_with_a_static_cache_runs_the_fast_path(target, static_calls):
    """`generate(assistant_model=drafter, cache_implementation="static")` (which transformers refuses for assisted
    generation) decodes with the static loop, exactly as plain greedy decoding, eos and budget included."""
    good = drafters(target)["good"]
    for ids, budget in ((torch.tensor([[5, 9, 11]]), 17), (torch.tensor([[30, 7, 4, 4]]), 40)):
        out = target.generate(ids, assistant_model=good, cache_implementation="static", max_new_tokens=budget,
                              do_sample=False)
        assert torch.equal(out, plain(target, ids, budget))
    assert len(static_calls) == 2 and static_calls[0]["eos_token_id"] == [EOS] and not static_calls[0]["do_sample"]
    assert static_calls[0]["compile"] is False  # compiled on CUDA only
    output = target.generate(torch.tensor([[5, 9]]), assistant_model=good, cache_implementation="static",
                             max_new_tokens=5, return_dict_in_generate=True)
    assert output.sequences.shape == (1, 7)


def test_generate_with_a_static_cache_passes_the_sampling_settings_and_the_global_seed(target, static_calls):
    good = drafters(target)["good"]
    ids = torch.tensor([[5, 9, 11]])
    draws = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        draws.append(target.generate(ids, assistant_model=good, cache_implementation="static", max_new_tokens=12,
                                     do_sample=True, temperature=0.7, top_k=9, top_p=0.8))
    assert torch.equal(draws[0], draws[1])
    assert {k: static_calls[0][k] for k in ("do_sample", "temperature", "top_k", "top_p")} == dict(
        do_sample=True, temperature=pytest.approx(0.7), top_k=9, top_p=pytest.approx(0.8))


@pytest.mark.parametrize("arguments,reason", [
    (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
    (dict(min_new_tokens=3), "MinNewTokensLengthLogitsProcessor"),
    (dict(max_time=10.0), "MaxTimeCriteria"),
    (dict(dspark_policy="static_threshold", dspark_threshold=0.5), "it verifies all drafts"),
    (dict(dspark_gamma=2), "it verifies all drafts"),
    (dict(streamer=type("Quiet", (BaseStreamer,), dict(put=lambda self, value: None, end=lambda self: None))()),
     "a streamer"),
    (dict(attention_mask=torch.tensor([[0, 1, 1]])), "padded prompt"),
    (dict(return_dict_in_generate=True, output_scores=True), "sequences only"),
])
def test_generate_with_a_static_cache_refuses_what_the_fast_path_cannot_do(target, arguments, reason):
    with pytest.raises(ValueError, match=reason):
        target.generate(torch.tensor([[5, 9, 11]]), assistant_model=drafters(target)["good"],
                        cache_implementation="static", max_new_tokens=5, **arguments)
