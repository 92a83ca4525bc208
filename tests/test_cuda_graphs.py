"""`GraphedFunction`: a compiled round replayed as one directly captured CUDA graph (the static loop's `compile=True`).

Off CUDA it calls the function as it is; `StaticRound` drops its captured round when the models' tensors move or
other kernels are chosen. The CUDA tests (skipped without a GPU; run on the GPU machine with the benchmarks) check
that replays run the captured work without calling the function, copy arguments in, start over on new shapes, and
that `static_generate(compile=True)` on the GPU equals plain `generate()` (float32), also after the weights moved.
"""

from __future__ import annotations

import pytest
import torch
from test_static_loop import EOS, VOCAB_SIZE, drafters, plain
from tiny_models import make_bigram_like, tiny_target

from dspark_hf.generation import static_generate
from dspark_hf.generation.cuda_graphs import GraphedFunction
from dspark_hf.generation.static_loop import StaticRound

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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


def test_static_round_drops_its_graph_when_what_it_reads_moves():
    """The validity key: the kernel choices and every parameter's and buffer's address; and the features buffer."""
    target = tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS)
    drafter = drafters(target)["random"]
    rounds = StaticRound(target, drafter, 64, compile=True, do_sample=False)
    graphed = rounds.compiled
    assert isinstance(graphed, GraphedFunction)
    rounds.keep_graph_valid(False, False)
    graphed.warm_calls = graphed.warmup  # as if warmed up (a capture needs CUDA)
    rounds.keep_graph_valid(False, False)
    assert graphed.warm_calls == graphed.warmup  # nothing moved
    rounds.keep_graph_valid(True, False)
    assert graphed.warm_calls == 0  # another kernel
    graphed.warm_calls = graphed.warmup
    rounds.keep_graph_valid(True, False)
    parameter = next(drafter.parameters())
    parameter.data = parameter.data.clone()
    rounds.keep_graph_valid(True, False)
    assert graphed.warm_calls == 0  # a parameter at a new address
    graphed.warm_calls = graphed.warmup
    features = torch.zeros(1, drafter.config.num_draft_slots + 1, 8)
    position = torch.tensor(3)
    rounds.start_greedy(torch.tensor([4]), position, features, position)
    assert graphed.warm_calls == 0  # a new features buffer
    graphed.warm_calls = graphed.warmup
    rounds.start_greedy(torch.tensor([4]), position, features, position)
    assert graphed.warm_calls == graphed.warmup  # the same buffer, refilled


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
def test_arguments_are_copied_in_and_new_shapes_start_over():
    fn = Counted(lambda x, scale: x * scale + 1)
    graphed = GraphedFunction(fn, "cuda", warmup=1)
    for value in range(4):
        x = torch.full((3,), float(value), device="cuda")
        assert torch.equal(graphed(x, 2.0).clone(), x * 2 + 1)
    assert fn.calls == 2
    x = torch.arange(5.0, device="cuda")  # a new shape: warm-up and capture again
    for _ in range(3):
        assert torch.equal(graphed(x, 2.0).clone(), x * 2 + 1)
    assert fn.calls == 4
    assert torch.equal(graphed(x, 3.0).clone(), x * 3 + 1)  # another constant: likewise
    assert fn.calls == 5


@cuda
@pytest.mark.parametrize("with_drafter", [True, False], ids=["dspark", "plain"])
def test_static_generate_on_cuda_replays_one_graph_and_equals_plain_generate(with_drafter):
    target = make_bigram_like(tiny_target("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=EOS))
    drafter = drafters(target)["good"].cuda() if with_drafter else None  # (built from the target on the CPU)
    target.cuda()
    for ids, new_tokens in ((torch.tensor([list(range(4, 16))]), 30), (torch.tensor([[5, 9, 11]]), 24)):
        ids = ids.cuda()
        assert torch.equal(static_generate(target, drafter, ids, new_tokens, compile=True), plain(target, ids, new_tokens))
    graphed = StaticRound._kept[drafter if with_drafter else target].compiled
    assert isinstance(graphed, GraphedFunction) and graphed.captured
    target.cpu().cuda()  # the weights move: the captured round must not read the old addresses
    if drafter is not None:
        drafter.cpu().cuda()
    ids = torch.tensor([list(range(6, 20))], device="cuda")
    assert torch.equal(static_generate(target, drafter, ids, 30, compile=True), plain(target, ids, 30))
    assert graphed.captured


@cuda
@pytest.mark.parametrize("with_drafter", [True, False], ids=["dspark", "plain"])
def test_sampling_on_cuda_draws_the_same_tokens_replayed_and_eager(with_drafter):
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
