"""`GraphedFunction`: compiled rounds replayed as directly captured CUDA graphs (`compile=True` of the fast paths;
`DSPARK_CUDA_GRAPHS=trees` opts out).

Off CUDA it calls the function as it is; its dispatch (warm-up calls, one capture per argument signature, replays,
`reset()`) is checked on the CPU with the capture faked; `StaticRound` drops its captured round when the models'
tensors move or other kernels are chosen. The CUDA tests (skipped without a GPU; run on the GPU machine with the
benchmarks) check that replays run the captured work without calling the function, copy arguments in and keep one
capture per argument signature; that `static_generate(compile=True)` on the GPU equals plain `generate()` (float32),
also after the weights moved; that `static_generate_batch` and `DSparkEngine(static=True)` on the GPU equal solo
decoding with their graphs captured; and that the engine's sampled rounds, replayed, draw what its eager rounds draw.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_static_loop import EOS, VOCAB_SIZE, drafters, plain
from tiny_models import make_bigram_like, tiny_target

from dspark_hf.generation import static_generate
from dspark_hf.generation import cuda_graphs
from dspark_hf.generation.cuda_graphs import GraphedFunction, signature
from dspark_hf.generation.static_batch import StaticBatchRounds
from dspark_hf.generation.static_loop import StaticRound

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def direct(monkeypatch):
    """`compile=True` replays direct graphs (`DSPARK_CUDA_GRAPHS=direct`, also the default)."""
    monkeypatch.setenv(cuda_graphs.GRAPHS_VARIABLE, "direct")


class Counted:
    """A function that counts how often Python runs it (a replayed graph does not)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def test_off_cuda_every_call_runs_the_function():
    fn = Counted(lambda x, scale: x * scale)
    graphed = GraphedFunction(fn, "cpu")
    for value in range(5):
        assert torch.equal(graphed(torch.full((3,), float(value)), 2.0), torch.full((3,), 2.0 * value))
    assert fn.calls == 5 and not graphed.captured


def test_warmup_must_be_positive():
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        GraphedFunction(lambda: None, "cpu", warmup=0)


class FakeCapture:
    """Stands in for `cuda_graphs._Capture` on the CPU: a replay copies the arguments into the capture's inputs and
    runs the function on them, writing its result into the outputs the capture returned first (as a graph replay
    writes into its output buffers)."""

    made: list[FakeCapture] = []

    def __init__(self, fn, args, pool, context=contextlib.nullcontext):
        self.fn, self.pool, self.context, self.replays = fn, pool, context, 0
        self.inputs = tuple(arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args)
        self.outputs = None
        FakeCapture.made.append(self)

    def replay(self, args):
        for arg, kept in zip(args, self.inputs):
            if isinstance(kept, torch.Tensor):
                kept.copy_(arg)
        result = self.run()
        if self.outputs is None:
            self.outputs = result
        elif isinstance(result, tuple):
            for kept, new in zip(self.outputs, result):
                kept.copy_(new)
        elif result is not None:
            self.outputs.copy_(result)
        self.replays += 1
        return self.outputs

    def run(self):
        return self.fn(*self.inputs)


class FakeCaptureOfPython(FakeCapture):
    """A `FakeCapture` of a function whose Python runs at every replay on the CPU, so within the context that a
    real replay, running no Python, does without (the rounds' tap and kernel choices)."""

    def run(self):
        with self.context():
            return super().run()


class FakeStream:
    def wait_stream(self, other):
        pass


def test_calls_warm_up_capture_and_replay_per_signature(monkeypatch):
    """The dispatch, with the capture faked on the CPU: `warmup` direct calls per argument signature (on the side
    stream), then one capture each, replayed for every later call of that signature; `reset()` starts over."""
    monkeypatch.setattr(cuda_graphs, "_Capture", FakeCapture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    FakeCapture.made.clear()
    fn = Counted(lambda x, bias: x * 2 if bias is None else x * 2 + bias)
    entered = []
    graphed = GraphedFunction(fn, "cpu", warmup=2, pool="pool",
                              context=lambda: contextlib.nullcontext(entered.append(fn.calls)))
    graphed.on_cuda, graphed.side_stream = True, FakeStream()  # (what a CUDA device would set)
    x, bias = torch.arange(3.0), torch.ones(3)
    for step in range(4):
        assert torch.equal(graphed(x + step, None), (x + step) * 2)
    assert fn.calls == 4 and len(FakeCapture.made) == 1 and FakeCapture.made[0].replays == 2
    assert entered == [0, 1] and FakeCapture.made[0].context is graphed.context  # the warm-ups, not the replays
    for step in range(3):  # another signature (a tensor where None was): its own warm-up and capture
        assert torch.equal(graphed(x + step, bias), (x + step) * 2 + 1)
    assert len(FakeCapture.made) == 2 and FakeCapture.made[1].pool == "pool"
    first = graphed(x, None)
    assert first is graphed(x + 1, None) and torch.equal(first, (x + 1) * 2)  # the capture's outputs, rewritten
    assert len(FakeCapture.made) == 2 and graphed.warm_calls == {signature((x, None)): 2, signature((x, bias)): 2}
    graphed.reset()
    graphed(x, None)
    assert not graphed.captured and graphed.warm_calls == {signature((x, None)): 1}


def test_direct_graphs_are_the_default_and_trees_opt_out(monkeypatch):
    target = tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS)
    monkeypatch.setenv(cuda_graphs.GRAPHS_VARIABLE, "trees")
    assert not isinstance(StaticRound(target, None, 32, compile=True, do_sample=False).compiled, GraphedFunction)
    assert not isinstance(StaticBatchRounds(target, None, 2, 32, compile=True).compiled, GraphedFunction)
    monkeypatch.delenv(cuda_graphs.GRAPHS_VARIABLE)
    assert isinstance(StaticRound(target, None, 32, compile=True, do_sample=False).compiled, GraphedFunction)
    assert isinstance(StaticBatchRounds(target, None, 2, 32, compile=True).compiled, GraphedFunction)
    sampled = StaticBatchRounds(target, drafters(target)["random"], 2, 32, compile=True, do_sample=True)
    assert all(isinstance(function, GraphedFunction) for function in (  # (drafts and scores: captured outputs)
        sampled.compiled, sampled.sampled_round(0), sampled.sampled_round(2), sampled.greedy_round(2)))
    assert not isinstance(StaticRound(target, None, 32, compile=dict(dynamic=False), do_sample=False).compiled,
                          GraphedFunction)  # options are used as given
    monkeypatch.setenv(cuda_graphs.GRAPHS_VARIABLE, "graphs")
    with pytest.raises(ValueError, match="DSPARK_CUDA_GRAPHS must be 'trees' or 'direct'"):
        StaticRound(target, None, 32, compile=True, do_sample=False)


def test_static_round_drops_its_graph_when_what_it_reads_moves(direct):
    """The validity key: the kernel choices and every parameter's and buffer's address; and the features buffer."""
    target = tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS)
    drafter = drafters(target)["random"]
    rounds = StaticRound(target, drafter, 64, compile=True, do_sample=False)
    graphed = rounds.compiled
    assert isinstance(graphed, GraphedFunction)
    warmed = {(): graphed.warmup}  # as if warmed up (a capture needs CUDA)
    rounds.keep_graph_valid(False, False)
    graphed.warm_calls = dict(warmed)
    rounds.keep_graph_valid(False, False)
    assert graphed.warm_calls == warmed  # nothing moved
    rounds.keep_graph_valid(True, False)
    assert graphed.warm_calls == {}  # another kernel
    graphed.warm_calls = dict(warmed)
    rounds.keep_graph_valid(True, False)
    parameter = next(drafter.parameters())
    parameter.data = parameter.data.clone()
    rounds.keep_graph_valid(True, False)
    assert graphed.warm_calls == {}  # a parameter at a new address
    graphed.warm_calls = dict(warmed)
    features = torch.zeros(1, drafter.config.num_draft_slots + 1, 8)
    position = torch.tensor(3)
    rounds.start_greedy(torch.tensor([4]), position, features, position)
    assert graphed.warm_calls == {}  # a new features buffer
    graphed.warm_calls = dict(warmed)
    rounds.start_greedy(torch.tensor([4]), position, features, position)
    assert graphed.warm_calls == warmed  # the same buffer, refilled


def test_static_engine_drops_its_graphs_when_the_models_moved_while_it_was_idle(direct, monkeypatch):
    """`DSparkEngine(static=True)`: every round and the admission chunks are direct graphs; their captures go when a
    parameter moves, and the check runs when requests arrive at an idle batch (not per round, nor while busy)."""
    from dspark_hf.serving import DSparkEngine

    target = tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS)
    drafter = drafters(target)["random"]
    engine = DSparkEngine(target, drafter, max_batch_size=2, max_model_len=48, static=True, static_compile=True,
                          policy="fixed")
    runner = engine.runner
    graphed = [runner.rounds.compiled, runner.rounds.greedy_round(2), runner.admission.compiled_chunk,
               runner.admission.compiled_chunk_without_context]
    assert all(isinstance(function, GraphedFunction) for function in graphed)
    warmed = {(): 2}  # as if captured (a capture needs CUDA)
    runner.keep_graphs_valid()
    for function in graphed:
        function.warm_calls = dict(warmed)
    runner.keep_graphs_valid()
    assert all(function.warm_calls == warmed for function in graphed)  # nothing moved
    parameter = next(target.parameters())
    parameter.data = parameter.data.clone()
    runner.keep_graphs_valid()
    assert all(function.warm_calls == {} for function in graphed)

    checks = []  # (an engine with eager rounds, which the CPU runs)
    engine = DSparkEngine(target, drafter, max_batch_size=2, max_model_len=48, static=True, policy="fixed")
    monkeypatch.setattr(engine.runner, "keep_graphs_valid", lambda: checks.append(len(engine.runner.rows)))
    first = engine.add_request([5, 6, 7], max_tokens=40, ignore_eos=True)
    engine.step()
    assert not first.finished
    engine.add_request([5, 6], max_tokens=6)  # arrives at a busy batch: no check
    engine.run()
    engine.add_request([7, 8], max_tokens=4)  # idle again
    engine.run()
    assert checks == [0, 0]


def test_signature_fixes_tensor_shapes_and_other_values():
    one, other = torch.zeros(3), torch.ones(3)
    assert signature((one, None, 2.0)) == signature((other, None, 2.0))
    assert signature((one, None)) != signature((one, other))  # (top-k off, top-k on: two graphs)
    assert signature((one,)) != signature((torch.zeros(4),)) != signature((torch.zeros(4, dtype=torch.long),))
    assert signature((one, 2.0)) != signature((one, 3.0))


@cuda
def test_replays_run_the_captured_work_without_python():
    counter = torch.zeros((), device="cuda")
    doubled = torch.zeros((), device="cuda")

    def step():
        counter.add_(1)
        doubled.copy_(counter * 2)

    fn = Counted(step)
    graphed = GraphedFunction(fn, "cuda", warmup=2)
    for _ in range(6):
        graphed()
    assert graphed.captured and fn.calls == 3  # two warm-up calls and the capture
    assert int(counter) == 6 and int(doubled) == 12


@cuda
def test_arguments_are_copied_in_and_each_signature_has_its_own_capture():
    fn = Counted(lambda x, scale: x * scale + 1)
    graphed = GraphedFunction(fn, "cuda", warmup=1)
    for value in range(4):
        x = torch.full((3,), float(value), device="cuda")
        assert torch.equal(graphed(x, 2.0).clone(), x * 2 + 1)
    assert fn.calls == 2  # the warm-up and the capture
    y = torch.arange(5.0, device="cuda")  # a new shape: its own warm-up and capture
    for _ in range(3):
        assert torch.equal(graphed(y, 2.0).clone(), y * 2 + 1)
    assert fn.calls == 4
    assert torch.equal(graphed(y, 3.0).clone(), y * 3 + 1)  # another constant: likewise
    assert fn.calls == 5
    assert torch.equal(graphed(x, 2.0).clone(), x * 2 + 1)  # back to the first: replayed
    assert fn.calls == 5 and len(graphed.captures) == 2


@cuda
@pytest.mark.parametrize("with_drafter", [True, False], ids=["dspark", "plain"])
def test_static_generate_on_cuda_replays_one_graph_and_equals_plain_generate(with_drafter, direct):
    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    drafter = drafters(target)["good"].cuda() if with_drafter else None  # (built from the target on the CPU)
    target.cuda()
    long_prompt = torch.arange(150)[None] % (VOCAB_SIZE - 4) + 4  # three prefill chunks
    for ids, new_tokens in ((torch.tensor([list(range(4, 16))]), 30), (torch.tensor([[5, 9, 11]]), 24),
                            (long_prompt, 20), (long_prompt[:, :70], 20)):
        ids = ids.cuda()
        expected = plain(target, ids, new_tokens)
        assert torch.equal(static_generate(target, drafter, ids, new_tokens, compile=True), expected)
    kept = StaticRound._kept[drafter if with_drafter else target]
    graphed = kept.compiled
    assert isinstance(graphed, GraphedFunction) and graphed.captured and kept.prefill_chunk.captured
    target.cpu().cuda()  # the weights move: the captured round must not read the old addresses
    if drafter is not None:
        drafter.cpu().cuda()
    ids = torch.tensor([list(range(6, 20))], device="cuda")
    assert torch.equal(static_generate(target, drafter, ids, 30, compile=True), plain(target, ids, 30))
    assert graphed.captured
    ids = long_prompt[:, 10:].cuda()  # (the prefill's graph, dropped with the round's, captured again)
    assert torch.equal(static_generate(target, drafter, ids, 30, compile=True), plain(target, ids, 30))


@cuda
def test_the_few_rows_gemm_on_cuda_rounds_as_float32_products_and_keeps_bf16_tokens(direct, monkeypatch):
    """`skinny_linear`'s kernel compiled for the GPU: products of 1-16 rows round as float32 sums do (to one unit in
    the last place); a bf16 target's compiled rounds run it and give the tokens of eager rounds on cuBLAS."""
    from triton_interpreter import CountingKernel  # (triton is imported already: the interpreter stays off)

    from dspark_hf.generation import skinny_linear as skinny

    monkeypatch.setenv(skinny.SWITCH_VARIABLE, "1")
    generator = torch.Generator(device="cuda").manual_seed(0)
    for rows, columns, depth in ((1, 6144, 2560), (8, 19456, 2560), (16, 1024, 512), (5, 300, 130)):
        x = torch.randn(rows, depth, device="cuda", generator=generator).bfloat16()
        weight = (torch.randn(columns, depth, device="cuda", generator=generator) / depth ** 0.5).bfloat16()
        expected = (x.float() @ weight.float().T).bfloat16()
        got = skinny.linear(x, weight)
        ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp_min(1e-30)
        assert ((got.float() - expected.float()).abs() <= ulp * 1.01).all()
        assert (got != expected).float().mean().item() <= 0.01
    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    drafter = drafters(target)["good"].cuda().bfloat16()
    target.cuda().bfloat16()
    ids = torch.tensor([list(range(4, 16))], device="cuda")
    monkeypatch.setenv(skinny.SWITCH_VARIABLE, "0")
    expected = static_generate(target, drafter, ids, 30, compile=False)
    monkeypatch.setenv(skinny.SWITCH_VARIABLE, "1")
    launches = []
    monkeypatch.setattr(skinny, "_skinny_linear", CountingKernel(skinny._skinny_linear, launches))
    torch._dynamo.reset()
    assert torch.equal(static_generate(target, drafter, ids, 30, compile=True), expected)
    assert launches and StaticRound._kept[drafter].compiled.captured


@cuda
@pytest.mark.parametrize("with_drafter", [True, False], ids=["dspark", "plain"])
def test_sampling_on_cuda_draws_the_same_tokens_replayed_and_eager(with_drafter, direct):
    """Sampled rounds take their noise and settings as arguments: copied into the capture's inputs each round."""
    target = tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS)
    drafter = drafters(target)["random"].cuda() if with_drafter else None
    target.cuda()
    prompts = (torch.tensor([list(range(4, 16))], device="cuda"), torch.tensor([[5, 9, 11]], device="cuda"))
    outputs = {compile: [static_generate(target, drafter, ids, 12, do_sample=True, temperature=0.8, top_k=20,
                                         seed=seed, compile=compile) for ids in prompts for seed in range(4)]
               for compile in (False, True)}
    assert all(torch.equal(a, b) for a, b in zip(outputs[False], outputs[True]))
    assert StaticRound._kept[drafter if with_drafter else target].compiled.captured


def cuda_solo(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = target.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@cuda
def test_static_generate_batch_on_cuda_replays_direct_graphs_and_equals_solo_generate(direct):
    """Greedy rounds work in place: directly captured graphs sharing one pool; every row equals its solo decoding."""
    from test_batched_generate import left_padded

    from dspark_hf.generation.static_batch import static_generate_batch

    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    oracle = drafters(target)["good"].cuda()
    target.cuda()
    prompts = [[5, 9, 11], list(range(4, 20)), [7, 30, 8, 12, 40, 6, 9, 21, 33]]
    for drafter in (None, oracle):
        ids, mask = left_padded(prompts)
        for _ in range(2):  # the second call replays what the first captured
            rows = static_generate_batch(target, drafter, ids.cuda(), mask.cuda(), 24, compile=True)
            assert rows == [cuda_solo(target, prompt, 24) for prompt in prompts]
        rounds = StaticBatchRounds._kept[drafter if drafter is not None else target]
        assert isinstance(rounds.compiled, GraphedFunction) and rounds.compiled.captured
        assert rounds.graph_pool is not None


@cuda
def test_static_engine_on_cuda_serves_exactly_with_direct_graphs(direct):
    """`DSparkEngine(static=True)` on the GPU: warm_up captures the greedy rounds of each width and prefix, the flush
    and the admission chunk; served greedy requests equal their solo decoding; sampled requests run."""
    import random

    from dspark_hf.serving import DSparkEngine

    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    drafter = drafters(target)["good"].cuda()
    target.cuda()
    engine = DSparkEngine(target, drafter, max_batch_size=4, max_model_len=96, static=True, policy="hardware_aware",
                          default_sampling={"temperature": 0})
    widths = (0, drafter.config.num_draft_slots)
    engine.warm_up(widths, sampled=True, progress=False, freeze_gc=False)
    captured = [function.captured for function in engine.runner.rounds._rounds_by_kind.values()
                if isinstance(function, GraphedFunction)]
    assert captured and all(captured)
    rng = random.Random(5)
    handles = [engine.add_request([rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(1, 12))],
                                  max_tokens=rng.randint(10, 40)) for _ in range(10)]
    sampled = [engine.add_request([5, 6, 7], max_tokens=20, temperature=0.9, ignore_eos=True) for _ in range(3)]
    engine.run()
    for handle in handles:
        assert handle.tokens == cuda_solo(target, handle.prompt_ids, handle.params.max_tokens)
    assert all(len(handle.tokens) == 20 for handle in sampled)


def sampled_engine_tokens(target, drafter, compiled: bool, max_model_len: int, max_tokens: int):
    """Five sampled requests (temperature 0.9, top-k 20) served by a warmed-up static engine, its generator seeded
    after warm-up: (each request's tokens, the engine)."""
    from dspark_hf.serving import DSparkEngine

    engine = DSparkEngine(target, drafter, max_batch_size=4, max_model_len=max_model_len, static=True, policy="fixed",
                          static_compile=compiled, default_sampling={"temperature": 0.9, "top_k": 20})
    engine.warm_up(sampled=True, progress=False, freeze_gc=False)
    engine.generator.manual_seed(3)
    handles = [engine.add_request(prompt, max_tokens=max_tokens, ignore_eos=True)
               for prompt in ([5, 6, 7], list(range(4, 16)), [9, 30, 11], [12, 13], [40, 41, 42, 43])]
    engine.run()
    return [handle.tokens for handle in handles], engine


def fake_graphed_rounds(monkeypatch, capture: type[FakeCapture]) -> None:
    """The static batch's rounds with `compile=True` become uncompiled `GraphedFunction`s whose captures are faked by
    `capture` on the CPU; with `compile=False` they stay eager."""
    from dspark_hf.generation import static_batch

    monkeypatch.setattr(cuda_graphs, "_Capture", capture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    FakeCapture.made.clear()

    def graphed_round(fn, compile, device, pool=None, context=contextlib.nullcontext):
        if not compile:
            return cuda_graphs.in_context(fn, context)
        graphed = GraphedFunction(fn, "cpu", pool=pool, context=context)
        graphed.on_cuda, graphed.side_stream = True, FakeStream()
        return graphed

    monkeypatch.setattr(static_batch, "compiled_round", graphed_round)


def test_static_engine_replays_rounds_outside_the_kernels_context(monkeypatch):
    """Choosing the kernels (the models' attention implementation, projection fusion) cost the host about 25 µs per
    model and round: the static engine enters that context only where the models' Python runs (the first prefill,
    warm-ups and captures), not around replayed rounds and admission chunks. Checked with captures faked."""
    from dspark_hf.generation import static_rows
    from dspark_hf.serving import DSparkEngine

    fake_graphed_rounds(monkeypatch, FakeCapture)
    entered = []
    choose_kernels = static_rows.kernels_active
    monkeypatch.setattr(static_rows, "kernels_active", lambda *args: (entered.append(1), choose_kernels(*args))[1])
    target = tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS)
    engine = DSparkEngine(target, None, max_batch_size=2, max_model_len=48, static=True, policy="none",
                          static_compile=True, default_sampling={"temperature": 0})
    engine.warm_up(progress=False, freeze_gc=False)
    handles = [engine.add_request([5, 6, 7], max_tokens=12)]
    engine.step()
    before = len(entered)
    assert before > 0  # warm-ups, captures, the first prefill
    handles += [engine.add_request(list(range(4, 4 + length)), max_tokens=12) for length in (3, 9)]
    engine.run()
    replays = sum(capture.replays for capture in FakeCapture.made)
    assert replays > 10 and len(entered) == before  # served rounds and admissions only replayed
    for handle in handles:
        prompt = handle.prompt_ids
        assert handle.tokens == plain(target, torch.tensor([prompt]), 12)[0, len(prompt):].tolist()


def test_static_engine_sampled_rounds_with_faked_captures_draw_as_eager_rounds(monkeypatch):
    """The GPU test below on the CPU, with every round a `GraphedFunction` whose capture is faked (`FakeCapture`: the
    replay's outputs are the first call's tensors, overwritten by each later replay, as a graph's are): the engine's
    sampled rounds read each round's drafts and scores before the next replay, so they draw what eager rounds draw."""
    fake_graphed_rounds(monkeypatch, FakeCaptureOfPython)  # (the CPU runs the rounds' Python at each replay)
    target = tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS)
    drafter = drafters(target)["random"]  # (random drafts: rejections and resampling every round)
    tokens = {graphed: sampled_engine_tokens(target, drafter, graphed, max_model_len=64, max_tokens=16)[0]
              for graphed in (False, True)}
    replays = [capture.replays for capture in FakeCapture.made]
    assert replays and sum(replays) > 10  # served rounds replayed captures
    assert tokens[True] == tokens[False]


@cuda
def test_static_engine_sampled_rounds_on_direct_graphs_draw_as_eager_rounds(direct):
    """A sampled DSpark round replayed from its capture returns the capture's drafts and scores, which verification and
    `advance` read before the next replay: the engine draws the same tokens as with its rounds run eagerly (one seed,
    the same requests, the generator re-seeded after warm-up, which runs the graphs a different number of times)."""
    target = tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS)
    drafter = drafters(target)["random"].cuda()  # (random drafts: rejections and resampling every round)
    target.cuda()
    gamma = drafter.config.num_draft_slots
    tokens = {}
    for compiled in (False, True):
        tokens[compiled], engine = sampled_engine_tokens(target, drafter, compiled, max_model_len=96, max_tokens=24)
    rounds = engine.runner.rounds
    replayed = [view._rounds_by_kind["sampled", gamma] for view in (rounds, *rounds._prefixes.values())
                if ("sampled", gamma) in view._rounds_by_kind]  # (top-k rows: the same function, other arguments)
    assert replayed and all(isinstance(function, GraphedFunction) and function.captured for function in replayed)
    assert tokens[True] == tokens[False]
