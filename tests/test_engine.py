"""`DSparkEngine`: continuous batching with random arrivals and cancellations, per-request verify lengths, streaming,
clear refusals of bad requests, text / chat / stop-string prompts, a background loop, and per-request sampling."""

from __future__ import annotations

import gc
import itertools
import random
import time
import types
import weakref
from collections.abc import Callable

import pytest
import torch
from test_generation_sampling import ALPHA, NEW_TOKENS, VOCAB, chi_square_p_value, exact_distribution, oracle_drafter
from test_static_batch import assert_drafter_cache_holds_context, reference_drafts
from tiny_models import install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_target
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LogitsProcessorList, PreTrainedTokenizerFast, TemperatureLogitsWarper, TopKLogitsWarper

import dspark_hf  # noqa: F401
from dspark_hf.generation.static_admission import ChunkedAdmission
from dspark_hf.generation.static_batch import StaticBatchRounds
from dspark_hf.scheduling import RoundWidthChooser, SpeculationGuard, SPSTable
from dspark_hf.scheduling.round_widths import AFTER_PLAIN, acceptance_state
from dspark_hf.serving import DSparkEngine
from dspark_hf.serving import engine as engine_module
from dspark_hf.serving.admission import FreeRowsGate, JoinGate

VOCAB_SIZE = 48
EOS = 2


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def models(request):
    target = make_bigram_like(tiny_target(request.param, vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=7, markov_rank=VOCAB_SIZE), target)
    return target, drafter


_SOLO: dict = {}


def solo(target, prompt: list[int], max_tokens: int) -> list[int]:
    key = (id(target), tuple(prompt), max_tokens)
    if key not in _SOLO:
        out = target.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        _SOLO[key] = out[0, len(prompt):].tolist()
    return _SOLO[key]


def serve_exactly(engine: DSparkEngine, target, rng: random.Random, count: int, longest_prompt: int,
                  budgets: tuple[int, int]) -> None:
    """Queues `count` requests (random prompts of 1..`longest_prompt` tokens, budgets drawn from `budgets`), runs the
    engine, and checks that every request equals its solo greedy generate()."""
    handles = [engine.add_request([rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(1, longest_prompt))],
                                  max_tokens=rng.randint(*budgets)) for _ in range(count)]
    engine.run()
    for handle in handles:
        assert handle.tokens == solo(target, handle.prompt_ids, handle.params.max_tokens)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One character per token: 'A' = 0, 'B' = 1, 'C' = 2 (eos), ... (48 tokens)."""
    vocab = {chr(ord("A") + i): i for i in range(VOCAB_SIZE)}
    backend = Tokenizer(WordLevel(vocab, unk_token="A"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="C", pad_token="A")
    tokenizer.chat_template = ("{% for m in messages %}D{{ m['content'] }}E{% endfor %}"
                               "{% if add_generation_prompt %}F{% endif %}")
    return tokenizer


BAD_REQUESTS = [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[5, 6], max_tokens=0), "max_tokens"),
    (dict(prompt=[5, 6], max_tokens=-3), "max_tokens"),
    (dict(prompt=[5, 6], repetition_penalty=1.2), "Unknown sampling argument"),
    (dict(prompt=list(range(4, 44)) * 2), "context"),
    (dict(prompt=[5, 6], max_tokens=70), "exceeds the context"),
    (dict(prompt=[5, 99]), "outside the target's vocabulary"),
    (dict(prompt="hello"), "tokenizer"),
    (dict(prompt=[5, 6], top_p=0.0), "top_p"),
    (dict(prompt=[5, 6], temperature=-1.0), "temperature"),
]


def test_random_arrivals_and_cancellations(models):
    """36 requests arrive at random rounds (some sampling), some are cancelled, bad ones are refused in between."""
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=6, max_model_len=64, default_sampling={"temperature": 0})
    rng = random.Random(1234)
    streamed: dict[str, list[int]] = {}

    def on_token(rid, tokens):
        streamed.setdefault(rid, []).extend(tokens)

    handles, cancelled_at, refused = [], {}, 0
    pending = 36
    while pending or engine.has_unfinished():
        for _ in range(min(pending, rng.choice([0, 0, 1, 2, 3]))):
            prompt = [rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(1, 11))]
            sampling = dict(max_tokens=rng.randint(1, 30))
            if rng.random() < 0.2:
                sampling.update(temperature=1.0, top_k=rng.choice([0, 5]))
            handles.append(engine.add_request(prompt, on_token=on_token, **sampling))
            pending -= 1
        if rng.random() < 0.15:
            kwargs, message = rng.choice(BAD_REQUESTS)
            with pytest.raises(ValueError, match=message):
                engine.add_request(**kwargs)
            refused += 1
        live = [h for h in handles if not h.finished and h.request_id not in cancelled_at]
        if live and rng.random() < 0.12:
            victim = rng.choice(live)
            victim.cancel()
            cancelled_at[victim.request_id] = len(victim.tokens)
        engine.step()
        assert engine.num_running <= 6

    assert len(handles) == 36 and refused > 0 and len({h.request_id for h in handles}) == 36
    assert all(h.finished for h in handles) and engine.requests == {}  # finished requests leave the engine
    greedy_checked = cancelled = 0
    for handle in handles:
        out = handle.output()
        assert out.finish_reason in ("stop", "length", "cancelled")
        assert streamed.get(handle.request_id, []) == out.token_ids  # callback stream == final tokens
        assert list(handle.stream()) == out.token_ids  # iterator stream == final tokens, ends exactly once
        if handle.request_id in cancelled_at and out.finish_reason == "cancelled":
            cancelled += 1
            assert len(out.token_ids) == cancelled_at[handle.request_id]  # nothing after the cancel
            if handle.params.greedy:
                assert out.token_ids == solo(target, handle.prompt_ids, handle.params.max_tokens)[: len(out.token_ids)]
            continue
        assert 1 <= len(out.token_ids) <= handle.params.max_tokens
        assert (out.finish_reason == "stop") == (out.token_ids[-1] == EOS)
        if handle.params.greedy:
            assert out.token_ids == solo(target, handle.prompt_ids, handle.params.max_tokens)
            greedy_checked += 1
    assert cancelled > 0 and greedy_checked >= 20
    lengths = {n for entry in engine.round_log for n in entry["accepted"]}
    assert len(lengths) > 2  # requests accepted different lengths
    assert any(len(set(entry["accepted"])) > 1 for entry in engine.round_log)  # ... within one round


def test_each_request_drafts_from_exactly_its_committed_context(models):
    """Output equality cannot see the drafter's context. Requests join a running batch at different rounds (their
    prompt features go into the drafter cache at admission, in another column layout than the running rows'); each
    draft must equal the drafter's proposal given the request's whole committed context at once."""
    target, oracle = models
    for drafter in (tiny_drafter(target, block_size=5, seed=3), oracle):  # the oracle accepts: rows move apart
        engine = DSparkEngine(target, drafter, max_batch_size=4, max_model_len=64, policy="fixed",
                              default_sampling={"temperature": 0, "max_tokens": 14})
        drafts = []  # (committed context, anchor, drafted tokens) per row and round
        original = drafter.draft

        def recording_draft(anchor_ids, *args, **kwargs):
            proposal = original(anchor_ids, *args, **kwargs)
            drafts.extend((row.ids[:-1], row.ids[-1], tokens)
                          for row, tokens in zip(engine.runner.rows, proposal.tokens.tolist()))
            return proposal

        drafter.draft = recording_draft
        try:
            rng = random.Random(5)
            arrivals = {0: 2, 2: 1, 3: 2, 6: 1, 9: 2}  # round -> requests joining; widths differ in both directions
            for round_index in range(40):
                for _ in range(arrivals.get(round_index, 0)):
                    engine.add_request([rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(1, 20))])
                engine.step()
        finally:
            del drafter.draft  # the class method again
        assert not engine.has_unfinished() and len(drafts) > 30
        for context, anchor, tokens in drafts:
            assert tokens == reference_drafts(target, drafter, context, anchor)[: len(tokens)]


@pytest.mark.parametrize("policy,kwargs", [
    ("none", {}),
    ("fixed", dict(gamma=3)),
    ("static_threshold", dict(threshold=0.3)),
    ("hardware_aware", dict(sps_table=SPSTable([1, 4, 16, 64], [1.0, 0.9, 0.6, 0.2]))),
    ("hardware_aware_async", dict(sps_table=SPSTable([1, 4, 16, 64], [1.0, 0.9, 0.6, 0.2]))),
])
def test_policies_give_per_request_verify_lengths_and_stay_exact(models, policy, kwargs):
    target, drafter = models
    engine = DSparkEngine(target, drafter, policy=policy, max_batch_size=8, default_sampling={"temperature": 0},
                          speculation_guard=False, **kwargs)  # the guard's timing-driven plain rounds: tested below
    rng = random.Random(7)
    serve_exactly(engine, target, rng, 10, 11, (5, 25))
    verified = [n for entry in engine.round_log for n in entry["verify"]]
    if policy == "none":
        assert set(verified) == {0}
    elif policy == "fixed":
        assert max(verified) == 3
    else:
        assert len(set(verified)) > 2


def test_finished_requests_leave_the_engine_and_run_returns_what_it_saw_finish(models, monkeypatch):
    """A long-running engine holds only unfinished requests: the handle keeps a finished request's result, its id
    may be used again, cancelling it changes nothing, and `run()` returns the requests unfinished when it started.
    Its round log keeps the last `ROUND_LOG_ROUNDS` rounds."""
    target, drafter = models
    monkeypatch.setattr(engine_module, "ROUND_LOG_ROUNDS", 3)
    engine = DSparkEngine(target, drafter, max_batch_size=2, default_sampling={"temperature": 0})
    first = engine.add_request([5, 9, 11], max_tokens=6, request_id="a")
    assert list(first.stream()) == solo(target, [5, 9, 11], 6) and engine.requests == {}
    first.cancel()
    assert first.result().finish_reason == "length"
    again = engine.add_request([7, 8], max_tokens=5, request_id="a")  # the id is free again
    other = engine.add_request([4, 6, 9], max_tokens=7)
    outputs = engine.run()
    assert set(outputs) == {"a", other.request_id} and engine.requests == {}
    assert outputs["a"].token_ids == solo(target, [7, 8], 5) == again.result().token_ids
    assert outputs[other.request_id].token_ids == solo(target, [4, 6, 9], 7)
    assert engine.run() == {}
    with pytest.raises(ValueError, match="Unknown request_id"):
        engine.cancel("a")
    last_round = engine.round_log[-1]["ended"]
    engine.add_request([4, 6], max_tokens=30)  # (at most 8 tokens a round: four rounds or more)
    engine.run()
    assert len(engine.round_log) == 3 and engine.round_log[0]["ended"] > last_round  # the last three rounds only


def tracked_from(handle) -> int:
    """The garbage collector's tracked objects that a request handle holds, its engine and code aside: what keeping
    the handle adds to every full collection."""
    seen, stack, count = {id(handle.engine)}, [handle], 0
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(item))
        if gc.is_tracked(item):
            count += 1
            stack.extend(gc.get_referents(item))
    return count


@pytest.mark.parametrize("static", [False, True])
def test_finished_requests_and_the_round_log_hold_no_per_round_containers(models, static):
    """A finished handle that nobody streamed costs the garbage collector the same whatever its length (its stream
    queues positions, not a list per round), and it is freed by reference counting alone: its Row, which refers back
    to it, is let go when it finishes. The round log's entries leave the collector's lists. (After warm-up froze the
    start-up heap, the per-round lists of unread streams were most of what a full collection walked while serving,
    and every finished request waited for one; a full round log of lists at 256 rows would cost every full
    collection about 0.1 s.)"""
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=2, max_model_len=64, policy="none", static=static,
                          default_sampling={"temperature": 0})
    gc.disable()  # (freed below without a collection)
    try:
        short, long = engine.add_request([5, 9, 11], max_tokens=2), engine.add_request([5, 9, 11], max_tokens=40)
        engine.step()
        row = weakref.ref(long.row)
        engine.run()
        assert long.tokens == solo(target, [5, 9, 11], 40) and long.output().accepted == [0] * 39  # plain rounds
        assert row() is None and long.row is None
        assert tracked_from(long) == tracked_from(short)
        gc.collect()  # the round log's tuples of ints leave the collector's lists (CPython: at their first one)
        assert len(engine.round_log) >= 39
        assert not any(gc.is_tracked(entry[key]) for entry in engine.round_log for key in ("verify", "accepted"))
        assert list(long.stream()) == long.tokens and list(long.stream()) == []  # read once, after the end
        handle = weakref.ref(long)
        del long
        assert handle() is None
    finally:
        gc.enable()


def test_a_stream_left_mid_round_resumes_where_it_stopped(models):
    """Rounds commit several tokens at once; a stream abandoned after some of them, and a new one, together yield each
    token once."""
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=2, policy="fixed", default_sampling={"temperature": 0})
    handle = engine.add_request([5, 9, 11], max_tokens=30)
    first = list(itertools.islice(handle.stream(), 3))
    assert len(handle.tokens) > 3  # (the first round committed more than the stream took)
    assert first + list(handle.stream()) == handle.tokens == solo(target, [5, 9, 11], 30)


def test_bad_requests_are_refused_without_disturbing_others(models):
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_model_len=64, default_sampling={"temperature": 0})
    good = engine.add_request([5, 9, 11], max_tokens=20)
    engine.step()
    for kwargs, message in BAD_REQUESTS:
        with pytest.raises(ValueError, match=message):
            engine.add_request(**kwargs)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([4], request_id=good.request_id)
    with pytest.raises(ValueError, match="Unknown request_id"):
        engine.cancel("nope")
    assert len(engine.requests) == 1
    assert good.result().token_ids == solo(target, [5, 9, 11], 20)


def test_text_chat_and_stop_strings_stream_exact_tokens(models):
    target, drafter = models
    tokenizer = char_tokenizer()
    engine = DSparkEngine(target, drafter, tokenizer=tokenizer, default_sampling={"temperature": 0})
    text = engine.add_request("GHIJ", max_tokens=25)
    chat = engine.add_request([{"role": "user", "content": "KLM"}], max_tokens=25)
    assert chat.prompt_ids == tokenizer.apply_chat_template([{"role": "user", "content": "KLM"}],
                                                            add_generation_prompt=True, tokenize=True)["input_ids"]
    streamed = list(text.stream())  # drives the engine
    assert streamed == solo(target, text.prompt_ids, 25) == text.tokens
    assert text.output().text == tokenizer.decode(streamed, skip_special_tokens=True)
    assert chat.result().token_ids == solo(target, chat.prompt_ids, 25)
    # stop strings: the request ends at the token completing the string (kept), exactly as the solo output cut there
    reference = solo(target, text.prompt_ids, 25)
    chars = "GHIJ" + "".join(tokenizer.convert_ids_to_tokens(reference))
    stop = chars[7:9]  # two generated characters
    stopped = engine.add_request("GHIJ", max_tokens=25, stop=[stop])
    tokens = list(stopped.stream())
    end = next(i for i in range(len(reference)) if chars[: 4 + i + 1].endswith(stop))
    assert tokens == reference[: end + 1] and stopped.output().finish_reason == "stop"


def test_background_loop_and_cancel_while_streaming(models):
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=4, default_sampling={"temperature": 0})
    engine.start()
    try:
        handles = [engine.add_request([4 + i, 7, 9], max_tokens=30, ignore_eos=True) for i in range(6)]
        long_one = engine.add_request([6, 6, 6], max_tokens=60, ignore_eos=True)
        received = []
        for token in long_one.stream():
            received.append(token)
            if len(received) >= 3:
                long_one.cancel()
        results = [h.result() for h in handles]
    finally:
        engine.stop()
    assert long_one.output().finish_reason == "cancelled" and received == long_one.tokens
    assert 3 <= len(received) < 60
    for handle, result in zip(handles, results):
        assert result.finish_reason == "length" and len(result.token_ids) == 30


def test_cancels_reach_waiting_running_and_finished_requests_as_documented(models):
    """A waiting request cancelled never starts, a running one stops at the next round, a second cancel changes
    nothing, and one asked of a finished request leaves it as it finished; the others are served as if alone."""
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=2, max_model_len=64, default_sampling={"temperature": 0})
    first, running, waiting, later = (engine.add_request([5 + i, 7, 9], max_tokens=40) for i in range(4))
    engine.step()  # first and running joined; waiting and later wait
    waiting.cancel()
    engine.cancel(waiting.request_id)  # (again, through the engine: nothing more happens)
    engine.step()
    running.cancel()
    stopped_at = len(running.tokens)
    engine.run()
    finished_as = first.output().finish_reason
    first.cancel()  # finished: stays as it finished
    engine.step()
    assert waiting.output().finish_reason == "cancelled" and waiting.tokens == [] and waiting.row is None
    assert running.output().finish_reason == "cancelled" and len(running.tokens) == stopped_at > 0
    assert first.output().finish_reason == finished_as != "cancelled"
    for handle in (first, later):
        assert handle.tokens == solo(target, handle.prompt_ids, 40)
    assert engine._cancels == [] and engine.requests == {}


def test_engine_sampling_matches_target_distribution():
    """1500 requests per prompt through the engine (temperature 0.8); one chi-square test per prompt at ALPHA = 1e-3
    (a correct sampler fails a given seed with probability <= 0.2 % over the two prompts)."""
    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB, eos_token_id=None), damping=0.3)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    drafter = oracle_drafter(target, scale=3.0)
    engine = DSparkEngine(target, drafter, max_batch_size=1024, seed=99, policy="static_threshold", threshold=0.5)
    prompts, copies = [[4, 1, 5], [3, 3]], 1500
    handles = [engine.add_request(p, temperature=0.8, max_tokens=NEW_TOKENS) for p in prompts for _ in range(copies)]
    engine.run()
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8)])
    for index, prompt in enumerate(prompts):
        counts = {}
        for handle in handles[index * copies:(index + 1) * copies]:
            counts[tuple(handle.tokens)] = counts.get(tuple(handle.tokens), 0) + 1
        assert chi_square_p_value(counts, exact_distribution(target, processors, prompt), copies) > ALPHA
    accepted = [n for entry in engine.round_log for n in entry["accepted"]]
    assert 0 < sum(accepted) < len(accepted) * 2  # some drafts accepted, some rejected


class AlternatingGuard(SpeculationGuard):
    """Drafts every other round, whatever the timings (exercises plain rounds inside a speculative engine)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def should_draft(self, batch_size: int) -> bool:
        self.calls += 1
        return self.calls % 2 == 1


def test_plain_rounds_chosen_by_the_guard_stay_exact(models):
    target, drafter = models
    table = SPSTable([1, 4, 16, 64], [1.0, 0.9, 0.6, 0.2])
    engine = DSparkEngine(target, drafter, policy="hardware_aware", max_batch_size=4, sps_table=table,
                          speculation_guard=AlternatingGuard(), default_sampling={"temperature": 0})
    rng = random.Random(3)
    serve_exactly(engine, target, rng, 7, 9, (8, 30))
    kinds = [entry["speculative"] for entry in engine.round_log]
    assert kinds[:4] == [True, False, True, False]
    assert max(n for entry in engine.round_log if entry["speculative"] for n in entry["accepted"]) > 1
    assert all(set(entry["verify"]) == {0} for entry in engine.round_log if not entry["speculative"])


class RecordingGuard(AlternatingGuard):
    """Drafts every other round (or every round) and keeps what the engine reports about each speculative round."""

    def __init__(self, alternate: bool):
        super().__init__()
        self.alternate, self.records = alternate, []

    def should_draft(self, batch_size: int) -> bool:
        return super().should_draft(batch_size) or not self.alternate

    def record(self, batch_size, seconds, verify_seconds, verify_tokens, tokens, catch_up=False):
        self.records.append((batch_size, seconds, verify_seconds, verify_tokens, tokens, catch_up))


@pytest.mark.parametrize("alternate", [True, False])
def test_the_guard_hears_each_speculative_round_and_gets_the_policy_table(models, alternate):
    target, drafter = models
    table = SPSTable([1, 4, 16, 64], [1.0, 0.9, 0.6, 0.2])
    guard = RecordingGuard(alternate)
    engine = DSparkEngine(target, drafter, policy="hardware_aware", max_batch_size=3, sps_table=table,
                          speculation_guard=guard, default_sampling={"temperature": 0})
    assert guard.sps_table is table
    for length in (5, 7, 9):
        engine.add_request(list(range(4, 4 + length)), max_tokens=12)
    engine.run()
    speculative = [entry for entry in engine.round_log if entry["speculative"]]
    assert len(speculative) - 1 <= len(guard.records) <= len(speculative) and len(guard.records) > 2
    assert all(set(entry["verify"]) == {0} for entry in speculative[len(guard.records):])  # no budget left to draft
    for i, ((batch, seconds, verify_seconds, verify_tokens, tokens, catch_up), entry) in enumerate(
            zip(guard.records, speculative)):
        assert batch == entry["batch"] and 0 < verify_seconds < seconds
        assert verify_tokens == batch * (1 + max(entry["verify"]))
        assert tokens == sum(entry["accepted"]) + batch
        # a speculative round after a plain one (or the first round) also catches the drafter up
        assert catch_up == (alternate or i == 0)


def test_guard_on_by_default_for_hardware_aware_only(models):
    target, drafter = models
    table = SPSTable([1, 4, 16, 64], [1.0, 0.9, 0.6, 0.2])
    assert isinstance(DSparkEngine(target, drafter, policy="hardware_aware", sps_table=table).runner.guard,
                      SpeculationGuard)
    assert DSparkEngine(target, drafter, policy="fixed").runner.guard is None
    assert DSparkEngine(target, drafter, policy="hardware_aware", sps_table=table,
                        speculation_guard=False).runner.guard is None


@pytest.mark.parametrize("policy", ["fixed", "none"])
def test_round_profile_splits_each_round_and_changes_nothing(models, policy):
    target, drafter = models
    engine = DSparkEngine(target, drafter, policy=policy, max_batch_size=3, profile_rounds=True,
                          default_sampling={"temperature": 0})
    rng = random.Random(5)
    handles = [engine.add_request([rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(2, 8))], max_tokens=12)
               for _ in range(5)]
    engine.run()
    for handle in handles:
        assert handle.tokens == solo(target, handle.prompt_ids, 12)
    ms = engine.round_profile()
    assert set(ms) == {*dspark_hf.generation.profiling.PARTS, "round"}
    assert all(value >= 0 for value in ms.values())
    assert sum(ms[part] for part in dspark_hf.generation.profiling.PARTS) == pytest.approx(ms["round"])
    assert ms["prefill"] > 0 and ms["verify_forward"] > 0 and ms["verification"] > 0
    drafting = ("draft_backbone", "markov_sampling", "scheduler")
    assert all((ms[part] > 0) == (policy == "fixed") for part in drafting)
    assert engine.runner.profiler.rounds == sum(1 for _ in engine.round_log)
    with pytest.raises(ValueError, match="profile_rounds"):
        DSparkEngine(target, drafter).round_profile()


class RandomWidths(RoundWidthChooser):
    """Verifies a random number of drafts each round, whatever the timings: none (a plain round) with probability
    `plain_share`, else any of the other widths."""

    def __init__(self, widths, seed: int, plain_share: float = 0.25):
        super().__init__(widths)
        self.rng, self.plain_share = random.Random(seed), plain_share

    def choose(self, rows: int = 0, requests: int | None = None) -> int:
        return 0 if self.rng.random() < self.plain_share else self.rng.choice(self.widths[1:])


STATIC_SETTINGS = {"fixed": dict(policy="fixed"), "fixed_gamma_2": dict(policy="fixed", gamma=2),
                   "hardware_aware": dict(policy="hardware_aware"), "random_widths": dict(policy="hardware_aware"),
                   "plain": dict(policy="none")}


@pytest.mark.parametrize("setting", list(STATIC_SETTINGS))
def test_static_engine_serves_arrivals_and_cancellations_exactly(models, setting):
    """DSparkEngine(static=True): requests of random lengths arrive at random rounds and take free rows of the static
    caches, some are cancelled; every finished request equals its solo greedy generate() (a cancelled one, a prefix
    of it), and rows accept different numbers of drafts. With every policy: all drafts, 2 of them, the hardware-aware
    choice among plain rounds and 1, 3 or γ drafts (on this CPU's timings), and random such choices. Rounds run on the
    smallest power-of-two prefix of the rows that holds every request."""
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=4, max_model_len=64, static=True,
                          default_sampling={"temperature": 0}, **STATIC_SETTINGS[setting])
    if setting == "random_widths":
        engine.runner.chooser = RandomWidths(engine.runner.chooser.widths, seed=3)
    rng = random.Random(7)
    handles, pending = [], 20
    while pending or engine.has_unfinished():
        for _ in range(min(pending, rng.choice([0, 0, 1, 3]))):
            prompt = [rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(1, 24))]
            handles.append(engine.add_request(prompt, max_tokens=rng.randint(1, 64 - len(prompt))))
            pending -= 1
        live = [h for h in handles if not h.finished]
        if live and rng.random() < 0.1:
            rng.choice(live).cancel()
        engine.step()
        assert engine.num_running <= 4
    cancelled = 0
    for handle in handles:
        out = handle.output()
        expected = solo(target, handle.prompt_ids, handle.params.max_tokens)
        if out.finish_reason == "cancelled":
            cancelled += 1
            assert out.token_ids == expected[: len(out.token_ids)]
        else:
            assert out.token_ids == expected
        if out.finish_reason == "length":  # the rounds' accepted drafts count only the tokens the request got
            assert sum(accepted + 1 for accepted in out.accepted) == len(out.token_ids) - 1  # (1: prefill)
    assert cancelled > 0
    verified = {entry["verify"][0] for entry in engine.round_log}
    expected = {"fixed": {drafter.config.num_draft_slots}, "fixed_gamma_2": {2}, "plain": {0}}.get(
        setting, {0, 1, 3, drafter.config.num_draft_slots})
    assert verified == expected
    assert all(len(set(entry["verify"])) == 1 for entry in engine.round_log)  # one width per round
    assert engine.runner.rounds._prefixes  # some rounds ran on the first rows alone (the others were free)
    if setting != "plain":
        assert any(len(set(entry["accepted"])) > 1 for entry in engine.round_log)


class RecordingWidths(RandomWidths):
    """RandomWidths that notes each `choose` and `record` call, in order."""

    def __init__(self, widths, seed: int):
        super().__init__(widths, seed)
        self.calls, self.captured, self.seconds, self.states, self.overheads, self.refined = [], [], [], [], [], []
        self.admissions, self.finished = [], []

    def record_admission(self, seconds: float, requests: int, prompt_context: bool = True) -> None:
        self.admissions.append((seconds, requests, prompt_context))
        super().record_admission(seconds, requests, prompt_context)

    def record_finished(self, tokens: int, requests: int = 1) -> None:
        self.finished.append((tokens, requests))
        super().record_finished(tokens, requests)

    def choose(self, rows: int = 0, requests: int | None = None) -> int:
        width = super().choose(rows)
        self.calls.append(("choose", width, self.group(rows, requests)))
        return width

    def record(self, width: int, seconds: float, accepted: list[int], rows: int = 0, captured: bool = False,
               states: list[int] | None = None, requests: int | None = None, overhead: float | None = None,
               refined: bool = False) -> None:
        self.calls.append(("record", width, self.group(rows, requests), list(accepted)))
        self.captured.append(captured)
        self.seconds.append(seconds)
        self.overheads.append(overhead)
        self.states.append(states)
        self.refined.append(refined)


class RefiningWidths(RecordingWidths):
    """RecordingWidths whose `refine` turns half the rounds it sees to the widest width, noting which rounds (by
    the engine's round index) it changed."""

    def __init__(self, widths, seed: int, engine: DSparkEngine):
        super().__init__(widths, seed)
        self.engine, self.changed = engine, {}

    def refine(self, width: int, states, rows: int = 0) -> int:
        refined = self.widths[-1] if self.rng.random() < 0.5 else width
        self.changed[len(self.engine.round_log)] = refined != width
        return refined


@pytest.mark.parametrize("state_rows", [4, 2])
def test_static_engine_calls_its_chooser_while_the_device_runs_a_round(models, state_rows):
    """The static engine's chooser works while the device runs a round: after launching round k it records round
    k - 1 (width, rows, accepted drafts), then chooses round k + 1's width for round k's group (`group`: rows, and
    requests up to a power of two). Round k + 1 uses that choice, or, when it falls in another group (here the batch
    drains from 4 rows to 2 to 1), one made afresh before it. Every round is recorded exactly once, in order; the last
    one during the next round, once requests come again. Rounds of at most `state_rows` rows are recorded with each
    row's acceptance state before them (known after a round of at most that many rows, or a plain one)."""
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=4, max_model_len=96, static=True, policy="hardware_aware",
                          default_sampling={"temperature": 0})
    chooser = engine.runner.chooser = RecordingWidths(engine.runner.chooser.widths, seed=1)
    chooser.state_rows = state_rows
    for prompt, max_tokens in (([5, 6, 7], 24), ([8, 9], 8), ([10, 11, 12, 13], 40)):  # rows 1, 2, 0
        engine.add_request(prompt, max_tokens=max_tokens)
    engine.run()
    engine.add_request([5, 6], max_tokens=4)
    engine.step()
    calls = iter(chooser.calls)
    records = [call for call in chooser.calls if call[0] == "record"]
    assert len(records) == len(engine.round_log) - 1 > 5
    planned, fresh = None, []
    for index, (entry, (_, width, rows, accepted)) in enumerate(zip(engine.round_log, records)):
        if planned is None or planned[2] != rows:
            decided = next(calls)
            assert decided[0] == "choose" and decided[2] == rows
            fresh.append(rows)
        else:
            decided = planned
        assert decided[1] == width == entry["verify"][0]
        assert len(accepted) == entry["batch"] and all(0 <= a <= width for a in accepted)
        if index > 0:
            assert next(calls) == records[index - 1]
        planned = next(calls)
        assert planned[0] == "choose" and planned[2] == rows
    afresh = next(calls)  # (the last round left no rows: the next request's round chooses afresh)
    assert afresh[0] == "choose" and afresh[1] == engine.round_log[-1]["verify"][0]
    assert next(calls) == records[-1] and next(calls)[0] == "choose" and next(calls, None) is None
    assert fresh == [(4, 4), (2, 2), (1, 1)]
    # each round's rows' states: AFTER_PLAIN after a plain round, else what the row accepted in the last round
    checked = 0
    for index, (_, width, _, accepted) in enumerate(records):
        last = records[index - 1] if index else None
        if len(accepted) > state_rows:
            assert chooser.states[index] is None
        elif last is None or last[1] == 0:
            assert chooser.states[index] == [AFTER_PLAIN] * len(accepted)
        elif len(last[3]) > state_rows:  # (the states after a round of more rows are not kept)
            assert chooser.states[index] is None
        elif len(accepted) == len(last[3]):  # (no request left in between)
            assert chooser.states[index] == [acceptance_state(last[1], count) for count in last[3]]
            checked += 1
    assert checked > 3 and any(state not in (AFTER_PLAIN, 0) for states in chooser.states if states for state in states)
    assert (None in chooser.states) == (state_rows < 3)


def test_static_engine_tells_its_chooser_which_rounds_refine_changed(models):
    """A round whose width `refine` changed for its rows' states is recorded with `refined=True` (the chooser keeps
    its acceptance out of the average row's estimate), every other round with False."""
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=2, max_model_len=96, static=True, policy="hardware_aware",
                          default_sampling={"temperature": 0})
    chooser = engine.runner.chooser = RefiningWidths(engine.runner.chooser.widths, seed=4, engine=engine)
    for prompt, max_tokens in (([5, 6, 7], 30), ([8, 9], 20)):
        engine.add_request(prompt, max_tokens=max_tokens)
    engine.run()
    engine.add_request([5, 6], max_tokens=2)
    engine.step()
    assert len(chooser.refined) == len(engine.round_log) - 1 > 5
    assert chooser.refined == [chooser.changed.get(index, False) for index in range(len(chooser.refined))]
    assert True in chooser.refined and False in chooser.refined
    for index, refined in enumerate(chooser.refined):
        if refined:
            assert engine.round_log[index]["verify"][0] == chooser.widths[-1]


def test_static_engine_times_each_round_with_its_delivery_for_its_chooser(models, monkeypatch):
    """The chooser gets a round's whole time, from its start until its tokens are delivered (here each request's
    `on_token` takes 20 ms), and as its overhead the rest of the engine's step (here its join gate takes 10 ms before
    the round and 10 ms after): neither holds the admissions (here one that takes 300 ms) nor whatever runs between
    the engine's steps (here 200 ms)."""
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=2, max_model_len=96, static=True, policy="hardware_aware",
                          default_sampling={"temperature": 0})
    chooser = engine.runner.chooser = RecordingWidths(engine.runner.chooser.widths, seed=2)
    admit = engine.runner.admission.admit

    def slow(call, seconds):
        def wrapped(*args, **kwargs):
            time.sleep(seconds)
            return call(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(engine.runner.admission, "admit", slow(admit, 0.3))
    monkeypatch.setattr(engine.join_gate, "rows_to_join", slow(engine.join_gate.rows_to_join, 0.01))
    monkeypatch.setattr(engine.join_gate, "record", slow(engine.join_gate.record, 0.01))
    streaming = dict(ignore_eos=True, on_token=lambda request_id, tokens: time.sleep(0.02))
    engine.add_request([5, 6, 7], max_tokens=24, **streaming)
    rounds = 0
    while engine.has_unfinished():
        if rounds == 3:  # joins by the (slow) chunked admission: the engine has started
            engine.add_request([8, 9], max_tokens=8, **streaming)
        engine.step()
        rounds += 1
        time.sleep(0.2)
    engine.add_request([5, 6], max_tokens=4)  # (the last round is recorded during the next one)
    engine.step()
    assert len(chooser.seconds) == rounds == len(engine.round_log) - 1 > 5
    for seconds, overhead, entry in zip(chooser.seconds, chooser.overheads, engine.round_log):
        delivery = 0.02 * entry["batch"]  # (the log's step also holds a choice: µs)
        assert entry["step_seconds"] + delivery - 0.005 <= seconds < entry["step_seconds"] + delivery + 0.1
        assert 0.02 <= overhead < 0.05
        assert delivery <= entry["delivered"] - entry["ended"] < delivery + 0.1  # (the round log's delivery too)


def test_static_engine_tells_its_chooser_which_rounds_replay_graphs_warm_up_ran(models):
    """`warm_up()` runs each graph `WARM_UP_CALLS` times (compiled: the last call captures it), so the chooser may
    time those rounds from the first: a greedy round of a warmed width and row prefix, with its flush, is recorded
    as captured; sampled rounds (not warmed here) and every round of an engine that never warmed up are not."""
    target, drafter = models
    captured = {}
    for warm in (True, False):
        engine = DSparkEngine(target, drafter, max_batch_size=2, max_model_len=96, static=True,
                              policy="hardware_aware")
        widths = (0, drafter.config.num_draft_slots)
        chooser = engine.runner.chooser = RecordingWidths(widths, seed=4)
        chooser.plain_share = 0.5  # (plain rounds fill the pending context: flushes)
        if warm:
            engine.warm_up(widths, progress=False, freeze_gc=False)
            assert engine.runner.warmed == {(size, kind, width) for size in (1, 2) for kind, width in
                                            [("greedy", 0), ("greedy", widths[1]), ("bare greedy", 0), ("flush", 0),
                                             ("catch_up", 0)]}
        engine.add_request([5, 6, 7], max_tokens=40, temperature=0.0, ignore_eos=True)
        engine.run()
        greedy = len(chooser.captured) + 1  # (the last greedy round is recorded during the first sampled one)
        engine.add_request([5, 6, 7], max_tokens=12, temperature=0.8, ignore_eos=True)
        engine.run()
        captured[warm] = chooser.captured[:greedy], chooser.captured[greedy:]
    assert all(captured[True][0]) and len(captured[True][0]) > 5
    assert not any(captured[True][1]) and captured[True][1]
    assert not any(captured[False][0] + captured[False][1])


def check_drafts_every_round(runner, target, drafter) -> list[int]:
    """Wraps `runner.step` (a `StaticRows`): after each drafting round of width v, every request's v drafts must be the
    first v that the drafter proposes given its committed context from its row's `drafter_start` on; returns the list
    of those starts (one per request and drafting round), which fills as the rounds run."""
    step, starts = runner.step, []

    def checked_step():
        before = {slot: list(row.ids) for slot, row in enumerate(runner.owner) if row is not None}
        committed = step()
        if runner.drafted_last_round:
            for slot, ids in before.items():
                start = int(runner.rounds.drafter_start[slot] - runner.rounds.pad[slot])
                width = runner.owner[slot].drafted[-1]
                expected = reference_drafts(target, drafter, ids[:-1], ids[-1], start)[:width]
                assert runner.rounds.drafts[slot, :width].tolist() == expected
                starts.append(start)
        return committed

    runner.step = checked_step
    return starts


@pytest.mark.parametrize("head", [dict(), dict(head_type="rnn"), dict(markov_rank=0, confidence=False)],
                         ids=["vanilla", "rnn", "dflash"])
def test_static_engine_drafts_from_each_requests_whole_context_across_plain_rounds(models, head, monkeypatch):
    """Plain rounds put their features in the drafter's pending context, which the rows flush when full: with random
    widths and requests joining finished ones' rows, every drafting round proposes, for every request, what the
    drafter proposes given its whole committed context (a random drafter: its drafts depend on all of it), and after
    every round each request's row of the drafter cache holds exactly its context's K/V. Markov heads of each kind,
    and none (a DFlash drafter). Admissions alternate between chunks of γ + 2 tokens (longer prompts take several;
    two requests at once when two join) and one eager forward."""
    target, _ = models
    drafter = tiny_drafter(target, block_size=5, seed=3, **head)
    engine = DSparkEngine(target, drafter, max_batch_size=3, max_model_len=64, static=True, policy="hardware_aware",
                          admission_batch=2, default_sampling={"temperature": 0})  # (requests join in pairs)
    runner = engine.runner
    runner.admission = ChunkedAdmission(runner.rounds, chunk=runner.rounds.width + 1, rows=2)
    add, modes = runner.add, itertools.cycle([1, 64])  # every group in one eager forward / every request in chunks

    def alternating_add(rows):
        runner.eager_admission_from = next(modes)
        return add(rows)

    runner.add = alternating_add
    admissions = {"chunked": 0, "eager": 0, "chunked_pairs": 0}
    for name, owner in (("chunked", runner.admission), ("eager", runner.rounds)):
        def counted(*args, _admit=owner.admit, _name=name):
            admissions[_name] += 1
            admissions["chunked_pairs"] += _name == "chunked" and len(args[0]) == 2
            return _admit(*args)
        monkeypatch.setattr(owner, "admit", counted)
    runner.chooser = RandomWidths(runner.chooser.widths, seed=5, plain_share=0.7)  # runs of plain rounds
    checked = check_drafts_every_round(runner, target, drafter)
    step = runner.step

    def checked_step():
        committed = step()
        for slot, row in enumerate(runner.owner):
            if row is not None:
                assert_drafter_cache_holds_context(runner.rounds, slot, row.ids)
        return committed

    runner.step = checked_step
    flush, flushes = StaticBatchRounds.flush, []
    monkeypatch.setattr(StaticBatchRounds, "flush", lambda rounds: flushes.append(flush(rounds)))
    rng = random.Random(11)
    serve_exactly(engine, target, rng, 7, 12, (8, 30))
    plain = [entry for entry in engine.round_log if not entry["speculative"]]
    assert len(checked) > 10 and set(checked) == {0} and len(plain) > 5 and flushes
    assert admissions["chunked"] and admissions["eager"] and admissions["chunked_pairs"]


def first_drafting_starts(runner, checked: list[int]) -> Callable[[], list[int]]:
    """Wraps `runner.step` (after `check_drafts_every_round`) to note each request's committed length before every
    round; returns a function giving, for the first drafting round since, each request's start after a catch-up:
    its anchor's position - 2 (γ + 1), at least 0 (`StaticBatchRounds.catch_up`), and checks that round's upkeep."""
    step, noted = runner.step, []

    def noted_step():
        lengths, checked_before = [len(row.ids) for row in runner.owner if row is not None], len(checked)
        committed = step()
        if runner.drafted_last_round and not noted:
            noted.append((lengths, runner.upkeep, checked_before))
        return committed

    runner.step = noted_step

    def expected() -> list[int]:
        (lengths_then, upkeep, checked_before), = noted[:1]
        assert upkeep == "catch_up"
        assert checked[checked_before: checked_before + len(lengths_then)] == [
            max(length - 1 - runner.rounds.catch_up_tokens, 0) for length in lengths_then]
        return lengths_then

    return expected


@pytest.mark.parametrize("eager", [False, True], ids=["chunked", "eager"])
def test_static_engine_admits_without_the_prompts_drafter_context_after_a_run_of_plain_rounds(models, eager,
                                                                                               monkeypatch):
    """After `PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER` plain rounds in a row, requests join without their prompt's
    drafter context or features, in chunks or in one eager forward: their rows' drafter state is not written (here
    their drafter cache holds large noise). The first drafting round catches up: every request's drafts are what the
    drafter proposes given its context from its last 2 (γ + 1) tokens before the anchor on (a random drafter: its
    drafts depend on all of it), so the noise is never seen; every later drafting round too, and every request equals
    its solo greedy generate(). Once a round drafts, requests join with their prompt's context again."""
    from dspark_hf.generation import static_rows

    monkeypatch.setattr(static_rows, "PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER", 3)
    target, _ = models
    drafter = tiny_drafter(target, block_size=5, seed=3)
    engine = DSparkEngine(target, drafter, max_batch_size=3, max_model_len=64, static=True, policy="hardware_aware",
                          admission_batch=1, default_sampling={"temperature": 0})
    runner = engine.runner
    runner.eager_admission_from = 1 if eager else 64
    runner.chooser = chooser = RandomWidths(runner.chooser.widths, seed=5, plain_share=1.0)
    rng = random.Random(7)

    def request(length: int, budget: int):
        return engine.add_request([rng.randrange(4, VOCAB_SIZE) for _ in range(length)], max_tokens=budget)

    handles = [request(9, 40)]
    for _ in range(3):  # plain rounds only
        engine.step()
    rounds = runner.rounds
    for layer in rounds.drafter_cache.layers:  # every row's drafter cache: noise the drafter must not see
        layer.keys.normal_(std=30.0)
        layer.values.normal_(std=30.0)
    handles += [request(14, 30), request(11, 30)]
    assert runner.admitted_without_prompt_context == 0
    engine.step()  # both join without their prompts' drafter context; the round is bare
    assert runner.admitted_without_prompt_context == 2 and runner.behind

    chooser.plain_share = 0.3
    checked = check_drafts_every_round(runner, target, drafter)
    first_starts = first_drafting_starts(runner, checked)
    engine.run()
    assert len(first_starts()) == 3
    for handle in handles:
        assert handle.tokens == solo(target, handle.prompt_ids, handle.params.max_tokens)
    assert runner.plain_rounds_in_a_row < 3
    late = request(10, 12)  # after a drafting round: with the prompt's context
    engine.run()
    assert late.tokens == solo(target, late.prompt_ids, 12)
    assert int(rounds.drafter_start[0]) == int(rounds.pad[0]) and runner.admitted_without_prompt_context == 2


class ScriptedWidths(RoundWidthChooser):
    """Each round the next (width, reason) of `script` (one group of rounds: one choice a round)."""

    def __init__(self, widths, script: list[tuple[int, str]]):
        super().__init__(widths, state_rows=0)
        self.script = iter(script)

    def group(self, rows: int = 0, requests: int | None = None) -> tuple[int, int]:
        return (0, 0)

    def choose(self, rows: int = 0, requests: int | None = None) -> int:
        width, self.reason = next(self.script)
        return width


def test_static_engine_keeps_a_run_of_plain_rounds_through_the_choosers_probes(models, monkeypatch):
    """A round the chooser runs only to measure, confirm or refresh a drafting width neither ends nor lengthens a run
    of plain rounds: requests that join after it still skip their prompts' drafter context, and each request equals
    its solo greedy generate(). A drafting round the chooser chose ends the run."""
    from dspark_hf.generation import static_rows

    monkeypatch.setattr(static_rows, "PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER", 3)
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=8, max_model_len=64, static=True, policy="hardware_aware",
                          admission_batch=1, default_sampling={"temperature": 0})
    runner = engine.runner
    widths = runner.chooser.widths
    script = [(0, "keep")] * 3 + [(widths[-1], probe) for probe in ("measure", "confirm", "refresh")]
    script += [(0, "settled"), (widths[1], "switch")] + [(widths[1], "settled")] * 40
    runner.chooser = ScriptedWidths(widths, script)
    rng = random.Random(5)

    def request(budget: int):
        return engine.add_request([rng.randrange(4, VOCAB_SIZE) for _ in range(8)], max_tokens=budget)

    handles, runs = [request(40)], []
    for joining in (0, 0, 0, 1, 1, 1, 0, 1, 1):
        handles += [request(20) for _ in range(joining)]
        engine.step()
        runs.append((runner.plain_rounds_in_a_row, runner.admitted_without_prompt_context))
    assert runs == [(1, 0), (2, 0), (3, 0), (3, 1), (3, 2), (3, 3), (4, 3), (0, 4), (0, 4)]
    engine.run()
    for handle in handles:
        assert handle.tokens == solo(target, handle.prompt_ids, handle.params.max_tokens)


def plain_recording_engine(models, max_batch_size: int) -> tuple[DSparkEngine, RecordingWidths]:
    """A static hardware-aware engine (greedy) whose chooser is a RecordingWidths running plain rounds only."""
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=max_batch_size, max_model_len=64, static=True,
                          policy="hardware_aware", default_sampling={"temperature": 0})
    engine.runner.chooser = chooser = RecordingWidths(engine.runner.chooser.widths, seed=5)
    chooser.plain_share = 1.0
    return engine, chooser


def test_static_engine_tells_its_chooser_each_admission_and_its_kind(models, monkeypatch):
    """Every admission into running rows reaches the chooser (not the first prefill, which sets up every row: here
    `warm_up`'s): its seconds (here each chunked admission takes 50 ms more), its requests, and whether they joined
    with their prompts' drafter context (not in a long run of plain rounds). `warm_up` sets the chooser's
    `admission_ratio` from the two admission graphs' times (here the one without the drafter's context takes half
    as long). Every request that leaves its row tells the chooser the tokens it committed."""
    from dspark_hf.generation import static_rows

    monkeypatch.setattr(static_rows, "PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER", 3)
    engine, chooser = plain_recording_engine(models, max_batch_size=3)
    runner = engine.runner
    prefill = runner.admission.prefill

    def timed_prefill(input_ids, attention_mask, prompt_context=True):
        time.sleep(0.2 if prompt_context else 0.1)
        return prefill(input_ids, attention_mask, prompt_context)

    monkeypatch.setattr(runner.admission, "prefill", timed_prefill)
    engine.warm_up(progress=False, freeze_gc=False)
    assert 0.4 < chooser.admission_ratio < 0.8
    monkeypatch.setattr(runner.admission, "prefill", prefill)
    admit = runner.admission.admit

    def slow_admit(*args, **kwargs):
        time.sleep(0.05)
        return admit(*args, **kwargs)

    monkeypatch.setattr(runner.admission, "admit", slow_admit)
    handles = [engine.add_request([5, 6, 7], max_tokens=30)]  # (joins rows `warm_up` set up: timed)
    for _ in range(4):  # plain rounds only
        engine.step()
    handles.append(engine.add_request([8, 9, 10], max_tokens=6))
    engine.step()  # joins without its prompt's drafter context
    chooser.plain_share = 0.0
    for _ in range(2):
        engine.step()
    handles.append(engine.add_request([11, 12], max_tokens=6))
    engine.step()  # after a drafting round: with its prompt's context
    assert [(requests, context) for _, requests, context in chooser.admissions] == [(1, True), (1, False), (1, True)]
    assert all(0.05 <= seconds < 0.5 for seconds, _, _ in chooser.admissions)
    engine.run()
    assert sum(requests for _, requests in chooser.finished) == 3  # each request's tokens once, when it leaves
    assert sum(tokens for tokens, _ in chooser.finished) == sum(len(handle.tokens) for handle in handles)
    cold, chooser = plain_recording_engine(models, max_batch_size=3)
    cold.add_request([5, 6, 7], max_tokens=4)
    cold.step()  # the first prefill, of every row
    assert chooser.admissions == [] and chooser.admission_ratio == 1.0


def test_static_engine_runs_bare_plain_rounds_in_a_long_run_and_catches_up_before_drafting(models, monkeypatch):
    """From the `PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER`-th plain round in a row on, plain rounds are bare (the graph
    of plain decoding without a drafter: no features kept, no flush); before that, plain rounds keep their features and
    flush a full pending context. The next drafting round catches up first: its drafts are what the drafter proposes
    given the context from the anchor's last 2 (γ + 1) tokens on (the drafter cache held large noise before), as are
    every later round's; the output equals solo greedy generate()."""
    from dspark_hf.generation import static_rows
    from dspark_hf.generation.static_batch import StaticBatchRounds

    monkeypatch.setattr(static_rows, "PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER", 20)
    target, _ = models
    drafter = tiny_drafter(target, block_size=5, seed=3)
    engine = DSparkEngine(target, drafter, max_batch_size=2, max_model_len=96, static=True, policy="hardware_aware",
                          default_sampling={"temperature": 0})
    runner = engine.runner
    runner.chooser = chooser = RandomWidths(runner.chooser.widths, seed=5, plain_share=1.0)
    kinds, greedy_round = [], StaticBatchRounds.greedy_round
    monkeypatch.setattr(StaticBatchRounds, "greedy_round", lambda rounds, verify, bare=False: (
        kinds.append((verify, bare)), greedy_round(rounds, verify, bare))[1])
    handle = engine.add_request([5, 6, 7, 8, 9, 10], max_tokens=80, ignore_eos=True)
    for _ in range(30):  # plain rounds only
        engine.step()
    assert kinds == [(0, False)] * 20 + [(0, True)] * 10 and runner.behind
    upkeeps = [entry["upkeep"] for entry in engine.round_log]
    assert "flush" in upkeeps[:20] and set(upkeeps[20:]) == {None}
    for layer in runner.rounds.drafter_cache.layers:  # noise the drafter must not see
        layer.keys.normal_(std=30.0)
        layer.values.normal_(std=30.0)
    chooser.plain_share = 0.3
    checked = check_drafts_every_round(runner, target, drafter)
    first_starts = first_drafting_starts(runner, checked)
    engine.run()
    assert first_starts()[0] > 6 + 2 * runner.rounds.width  # (the catch-up starts past the prompt)
    assert len(checked) > 3 and not runner.behind and handle.tokens == solo(target, handle.prompt_ids, 80)
    assert [entry["upkeep"] for entry in engine.round_log].count("catch_up") == 1


def test_static_engine_times_a_round_for_its_chooser_without_the_catch_up_it_ran_first(models, monkeypatch):
    """A catch-up is the price of leaving a long run of plain rounds, not of the drafting width's rounds: `warm_up`
    times each row prefix's catch-up graph, and the chooser gets the time of the round that ran it first (a probe from
    such a run, typically) without it. Here every catch-up takes 100 ms more, many of the tiny models' rounds."""
    from dspark_hf.generation import static_rows
    from dspark_hf.generation.static_batch import StaticBatchRounds

    monkeypatch.setattr(static_rows, "PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER", 3)
    catch_up = StaticBatchRounds.catch_up
    monkeypatch.setattr(StaticBatchRounds, "catch_up", lambda rounds, recent: (time.sleep(0.1),
                                                                                catch_up(rounds, recent))[1])
    target, _ = models
    engine, chooser = plain_recording_engine(models, max_batch_size=2)
    runner = engine.runner
    engine.warm_up(progress=False, freeze_gc=False)
    assert sorted(runner.catch_up_seconds) == sorted(runner.graph_batch_sizes)
    assert all(0.1 <= seconds < 1.0 for seconds in runner.catch_up_seconds.values())
    handle = engine.add_request([5, 6, 7], max_tokens=24, ignore_eos=True)
    for _ in range(5):  # plain rounds, the last two bare
        engine.step()
    chooser.plain_share = 0.0
    for _ in range(4):  # one more plain round (chosen during the last), then drafting rounds: the first catches up
        engine.step()  # (each round's time is recorded during the next)
    caught_up = [entry["upkeep"] for entry in engine.round_log].index("catch_up")
    assert caught_up == 6 and engine.round_log[caught_up]["step_seconds"] >= 0.1
    records = [call for call in chooser.calls if call[0] == "record"]
    assert records[caught_up][1] > 0 and chooser.seconds[caught_up] < 0.1  # (a round of the tiny models: ~ms)
    engine.run()
    assert handle.tokens == solo(target, handle.prompt_ids, 24)


def test_static_engine_without_a_drafter_admits_through_its_one_admission_graph(models, monkeypatch):
    """Plain decoding (no drafter) runs only plain rounds: its admissions after any number of them still go through
    the admission graph that `warm_up()` captures (the one with the prompts' drafter context, which it lacks)."""
    from dspark_hf.generation import static_rows

    monkeypatch.setattr(static_rows, "PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER", 2)
    target, _ = models
    engine = DSparkEngine(target, None, max_batch_size=2, max_model_len=48, static=True, admission_batch=1,
                          default_sampling={"temperature": 0})
    admission, chunks = engine.runner.admission, []
    monkeypatch.setattr(admission, "compiled_chunk", lambda _chunk=admission.compiled_chunk: chunks.append(_chunk()))
    monkeypatch.setattr(admission, "compiled_chunk_without_context", lambda: pytest.fail("the graph without context"))
    first = engine.add_request([5, 6, 7], max_tokens=30, ignore_eos=True)
    for _ in range(4):
        engine.step()
    second = engine.add_request([8, 9], max_tokens=5)  # joins a running batch after 4 plain rounds: in chunks
    engine.run()
    assert chunks and first.tokens == solo(target, first.prompt_ids, 30) and second.tokens == solo(target, [8, 9], 5)
    assert engine.runner.admitted_without_prompt_context == 0


def test_chunked_admission_pads_prompts_to_whole_chunks_and_refuses_chunks_shorter_than_a_round(models):
    target, drafter = models
    rounds = DSparkEngine(target, drafter, max_batch_size=2, max_model_len=64, static=True).runner.rounds
    with pytest.raises(ValueError, match="chunk must hold"):
        ChunkedAdmission(rounds, chunk=rounds.width - 1)
    admission = ChunkedAdmission(rounds, chunk=16)  # at least γ + 2 columns: a drafter's first context
    assert [admission.padded_width(length) for length in (1, rounds.width + 1, 16, 17, 33)] == [16, 16, 16, 32, 48]


def test_static_engine_compiles_every_graph_at_warm_up_and_none_while_serving():
    """fullgraph=True: `warm_up(widths, sampled=True)` compiles each graph that rounds of those widths can run once:
    per row prefix (all rows, the first alone), plain rounds, bare plain rounds and γ drafts, greedy and sampled with
    and without top-k / top-p, the flush, the catch-up and the admission chunks (with and without the prompts'
    drafter context); serving greedy and sampled requests of both widths afterwards compiles nothing more, and the
    greedy outputs are still the solo greedy ones. (Two widths, one target family: tracing takes about half a
    minute.)"""
    from test_static_loop import counting_backend

    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=7, markov_rank=VOCAB_SIZE), target)
    compilations, backend = counting_backend()
    torch._dynamo.reset()
    engine = DSparkEngine(target, drafter, max_batch_size=2, max_model_len=64, static=True, policy="hardware_aware",
                          static_compile=dict(backend=backend, fullgraph=True, dynamic=False),
                          default_sampling={"temperature": 0})
    widths = (0, drafter.config.num_draft_slots)
    graphs = engine.warm_up(widths, sampled=True, progress=False)
    # prefixes 1 and 2: three kinds of each width and of bare plain rounds, the flush and the catch-up; the admission
    # chunk with and without the prompts' drafter context
    assert graphs == 2 * (len(widths) + 1) * 3 + 2 * 2 + 2 == len(compilations)
    engine.runner.chooser = RandomWidths(widths, seed=2, plain_share=0.5)
    rng = random.Random(3)
    serve_exactly(engine, target, rng, 5, 10, (10, 30))
    greedy_rounds = len(engine.round_log)
    sampled = [engine.add_request([rng.randrange(4, VOCAB_SIZE) for _ in range(4)], max_tokens=30, temperature=0.9,
                                  top_p=0.9 if index else 1.0, ignore_eos=True) for index in range(3)]
    engine.run()
    assert all(len(handle.tokens) == 30 for handle in sampled)
    log = list(engine.round_log)
    ran = [{entry["verify"][0] for entry in rounds} for rounds in (log[:greedy_rounds], log[greedy_rounds:])]
    assert ran[0] == set(widths) and len(ran[1]) > 1
    assert len(compilations) == graphs  # nothing compiled while serving
    engine.add_request([5, 6], max_tokens=20)  # (a round commits at most 8: still running after one)
    engine.step()
    with pytest.raises(RuntimeError, match="before the first request"):
        engine.warm_up()


def test_static_engine_runs_only_the_graph_batch_sizes_it_is_given(models):
    """`static_graph_batch_sizes=(2,)` on 4 rows: warm_up runs 2 sizes (2 and the whole 4) × (2 widths + the bare plain
    round, the flush and the catch-up) and 2 admission chunks;
    rounds of any occupancy run 2 or 4 rows, never 1, and stay exact. warm_up freezes the collector's objects unless
    told not to; the engine is still freed when dropped. Sizes outside 1..max_batch_size are refused, as is the
    option on the eager engine."""
    target, drafter = models
    widths = (0, drafter.config.num_draft_slots)
    engine = DSparkEngine(target, drafter, max_batch_size=4, max_model_len=64, static=True, policy="hardware_aware",
                          static_graph_batch_sizes=(2,), default_sampling={"temperature": 0})
    assert engine.runner.graph_batch_sizes == (2, 4)
    gc.unfreeze()
    graphs = 2 * (len(widths) + 3) + 2  # (the admission chunk with and without the prompts' context)
    assert engine.warm_up(widths, progress=False, freeze_gc=False) == graphs and gc.get_freeze_count() == 0
    assert engine.warm_up(widths, progress=False) == graphs and gc.get_freeze_count() > 0
    assert all(item is not engine for item in gc.get_objects())  # frozen: out of the collector's reach
    engine.runner.chooser = RandomWidths(widths, seed=1, plain_share=0.5)
    serve_exactly(engine, target, random.Random(5), 6, 10, (1, 30))
    assert set(engine.runner.rounds._prefixes) == {2}  # (4 rows: the rounds object itself)
    assert {entry["batch"] for entry in engine.round_log} >= {1, 4}  # one request alone ran on 2 rows
    dropped = weakref.ref(engine)
    del engine
    gc.collect()
    assert dropped() is None  # frozen, and still freed (with its caches) once nothing refers to it
    for sizes in ((0, 2), (8,)):
        with pytest.raises(ValueError, match="graph_batch_sizes must lie in"):
            DSparkEngine(target, drafter, max_batch_size=4, max_model_len=64, static=True,
                         static_graph_batch_sizes=sizes)
    for option in (dict(static_graph_batch_sizes=(2,)), dict(static_admission_rows=2)):
        with pytest.raises(ValueError, match="apply to DSparkEngine.static=True"):
            DSparkEngine(target, drafter, max_batch_size=4, **option)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_admission_batch_waits_for_enough_free_rows(models, static):
    """admission_batch=3: after the first prefill, waiting requests join only when at least 3 rows are free (or
    fewer requests wait); outputs stay exact. With the default, requests join one or two at a time as rows free."""
    target, drafter = models
    sizes = {}
    for batch in (1, 3):
        engine = DSparkEngine(target, drafter, max_batch_size=4, max_model_len=64, static=static, policy="fixed",
                              admission_batch=batch, default_sampling={"temperature": 0})
        rng = random.Random(2)
        serve_exactly(engine, target, rng, 14, 9, (4, 40))
        sizes[batch] = [entry["admitted"] for entry in engine.round_log if entry["admitted"]]
        assert sum(sizes[batch]) == 14 and sizes[batch][0] == 4
    remaining = 10
    for size in sizes[3][1:]:
        assert min(3, remaining) <= size <= 4
        remaining -= size
    assert min(sizes[1]) < 3 and len(sizes[1]) > len(sizes[3])


class FixedCostGate(JoinGate):
    """A `JoinGate` whose joins cost `seconds` a set, whatever the engine measures."""

    def __init__(self, rows_per_set: int, seconds: float):
        super().__init__(rows_per_set)
        self.seconds = seconds

    def set_seconds(self) -> float:
        return self.seconds


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_admission_batch_auto_holds_joins_that_cost_more_than_idle_rows(models, static):
    """admission_batch="auto" (`JoinGate`; one admission set: the static engine's 2 admission rows, the eager engine's
    whole batch of 4): outputs stay exact. Joins that cost more than any hold could idle wait for a whole set of free
    rows (or for room for every waiting request; rows free often enough here that a hold always may gather more);
    joins that cost nothing go as soon as a row frees, as with admission_batch=1."""
    target, drafter = models
    sizes = {}
    for setting in ("auto", 1e9, 0.0, 1):
        engine = DSparkEngine(target, drafter, max_batch_size=4, max_model_len=64, static=static, policy="fixed",
                              admission_batch="auto" if setting != 1 else 1, default_sampling={"temperature": 0},
                              **(dict(static_admission_rows=2) if static else {}))
        if setting != 1:
            assert engine.join_gate.rows_per_set == (2 if static else 4)
        if isinstance(setting, float):
            engine.join_gate = FixedCostGate(engine.join_gate.rows_per_set, setting)
        serve_exactly(engine, target, random.Random(2), 14, 9, (4, 40))
        sizes[setting] = [entry["admitted"] for entry in engine.round_log if entry["admitted"]]
        assert sum(sizes[setting]) == 14 and sizes[setting][0] == 4
    remaining = 10
    for size in sizes[1e9][1:]:  # whole sets (2 rows, up to 4; eager: all 4), or every waiting request
        if static:
            assert min(2, remaining) <= size <= 4 and (size % 2 == 0 or size == remaining)
        else:
            assert size == min(4, remaining)
        remaining -= size
    assert sizes[0.0] == sizes[1] and min(sizes[1]) < 2
    default = DSparkEngine(target, drafter, max_batch_size=4, max_model_len=64, static=static, policy="fixed").join_gate
    if static:  # the default: "auto" on static caches, 1 (join at once) on the eager engine
        assert isinstance(default, JoinGate)
    else:
        assert isinstance(default, FreeRowsGate) and default.admission_batch == 1
    with pytest.raises(ValueError, match="auto"):
        DSparkEngine(target, drafter, max_batch_size=4, admission_batch="sometimes")


def test_static_engine_refuses_what_it_does_not_do(models):
    target, drafter = models
    with pytest.raises(ValueError, match="max_model_len"):
        DSparkEngine(target, drafter, static=True, policy="fixed")
    with pytest.raises(ValueError, match="measures its own round times"):
        DSparkEngine(target, drafter, static=True, max_model_len=64, policy="hardware_aware",
                     sps_table=SPSTable([1, 4], [1.0, 0.9]))
    with pytest.raises(ValueError, match="not 'static_threshold'"):
        DSparkEngine(target, drafter, static=True, max_model_len=64, policy="static_threshold")
    with pytest.raises(ValueError, match="gamma applies"):
        DSparkEngine(target, drafter, static=True, max_model_len=64, policy="fixed", gamma=99)
    with pytest.raises(ValueError, match="speculation_guard"):
        DSparkEngine(target, drafter, static=True, max_model_len=64, policy="hardware_aware", speculation_guard=True)
    with pytest.raises(ValueError, match="admission_batch"):
        DSparkEngine(target, drafter, max_batch_size=4, admission_batch=5)


def test_static_engine_sampling_matches_target_distribution(monkeypatch):
    """DSparkEngine(static=True) with sampled requests (two settings, one after the other: temperature 0.8, whose
    rounds skip top-k / top-p; temperature 1.1 with top-k 4) and greedy ones in the same rounds, through random widths
    (sampled plain rounds, bare ones from the second in a row, 1 or all 3 drafts verified, catching up after bare
    rounds): 1500 requests per sampled prompt, one chi-square test per prompt at ALPHA = 1e-3 (a correct sampler fails
    a given seed with probability <= 0.2 % over the two); the greedy requests equal their solo greedy generate()."""
    from dspark_hf.generation import static_rows

    monkeypatch.setattr(static_rows, "PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER", 1)
    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB, eos_token_id=None), damping=0.3)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    drafter = oracle_drafter(target, scale=3.0)
    engine = DSparkEngine(target, drafter, max_batch_size=256, max_model_len=8, seed=99, static=True,
                          policy="hardware_aware")
    engine.runner.chooser = RandomWidths(engine.runner.chooser.widths, seed=4, plain_share=0.5)
    settings = [([4, 1, 5], dict(temperature=0.8), [TemperatureLogitsWarper(0.8)]),
                ([3, 3], dict(temperature=1.1, top_k=4), [TemperatureLogitsWarper(1.1), TopKLogitsWarper(4)])]
    unfiltered, sampled_round = [], StaticBatchRounds.sampled_round  # per sampled round: did it skip top-k / top-p?
    bare_rounds = []

    def recording_sampled_round(rounds, verify, bare=False):
        bare_rounds.append(bare)
        return lambda noise, *settings: (unfiltered.append(settings[1] is None),
                                         sampled_round(rounds, verify, bare)(noise, *settings))[1]

    monkeypatch.setattr(StaticBatchRounds, "sampled_round", recording_sampled_round)
    copies, greedy = 1500, []
    for (prompt, sampling, processors), skips in zip(settings, (True, False)):
        handles, unfiltered[:] = [], []
        for copy in range(copies):
            handles.append(engine.add_request(prompt, max_tokens=NEW_TOKENS, **sampling))
            if copy % 100 == 0:
                greedy.append(engine.add_request([5, copy % VOCAB], max_tokens=NEW_TOKENS, temperature=0))
        engine.run()
        counts = {}
        for handle in handles:
            counts[tuple(handle.tokens)] = counts.get(tuple(handle.tokens), 0) + 1
        expected = exact_distribution(target, LogitsProcessorList(processors), prompt)
        assert chi_square_p_value(counts, expected, copies) > ALPHA
        assert set(unfiltered) == {skips}
    for handle in greedy:
        assert handle.tokens == solo(target, handle.prompt_ids, NEW_TOKENS)
    accepted = [n for entry in engine.round_log if entry["speculative"] for n in entry["accepted"]]
    assert 0 < sum(accepted) < len(accepted) * 2  # some drafts accepted, some rejected
    assert {entry["verify"][0] for entry in engine.round_log} == {0, 1, 3}
    assert set(bare_rounds) == {True, False} and "catch_up" in {entry["upkeep"] for entry in engine.round_log}


def test_static_engine_writes_rows_sampling_settings_only_where_they_change(models):
    """Greedy requests leave the rows' device sampling settings as they were; a sampled request's row keeps its
    settings after the request finished (freeing a row writes none) until a greedy request takes the row: temperature
    1, no top-k / top-p. Outputs stay plain greedy decoding's."""
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=2, max_model_len=48, static=True, policy="fixed", seed=3)
    runner, prompt = engine.runner, [5, 6, 7]

    def serve_greedy() -> None:
        handles = [engine.add_request(prompt, max_tokens=6, temperature=0) for _ in range(2)]
        engine.run()
        assert [handle.tokens for handle in handles] == [solo(target, prompt, 6)] * 2

    runner.temperature.fill_(0.5)  # no greedy row's setting: greedy requests run with it and leave it
    serve_greedy()
    assert runner.temperature.tolist() == [0.5, 0.5]
    engine.add_request(prompt, max_tokens=4, temperature=0.7, top_k=5, top_p=0.9)
    engine.run()
    assert runner.temperature.tolist() == pytest.approx([0.7, 0.5]) and runner.top_k.tolist() == [5, 0]
    assert runner.top_p.tolist() == pytest.approx([0.9, 1.0]) and runner.sampled == [False, False]
    serve_greedy()
    assert runner.temperature.tolist() == [1.0, 0.5] and runner.top_k.tolist() == [0, 0]
    assert runner.top_p.tolist() == [1.0, 1.0]


def test_static_engine_prefills_a_group_eagerly_only_when_its_chunks_would_take_eight_passes(models, monkeypatch):
    """Requests of similar lengths joining together go through the admission chunks `static_admission_rows` at a
    time, or, from 8 × that many on (eight passes), in one eager forward; the outputs stay plain greedy decoding's."""
    target, drafter = models
    engine = DSparkEngine(target, drafter, max_batch_size=16, max_model_len=48, static=True, policy="fixed",
                          static_admission_rows=2, default_sampling={"temperature": 0})
    runner = engine.runner
    assert runner.eager_admission_from == 16
    engine.warm_up(progress=False)
    eager_groups = []
    admit = runner.rounds.admit
    monkeypatch.setattr(runner.rounds, "admit", lambda slots, *rest: eager_groups.append(len(slots)) or admit(slots,
                                                                                                             *rest))
    rng = random.Random(7)
    for count in (15, 16):  # all at once, one length: one group
        prompts = [[rng.randrange(4, VOCAB_SIZE) for _ in range(6)] for _ in range(count)]
        handles = [engine.add_request(prompt, max_tokens=4) for prompt in prompts]
        engine.run()
        assert [handle.tokens for handle in handles] == [solo(target, prompt, 4) for prompt in prompts]
    assert eager_groups == [16]  # 15 requests: 8 chunk passes of up to 2 rows; 16: one eager forward
