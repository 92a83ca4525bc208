"""Where the fast path's round spends its time: `profile_static_round` times a greedy DSpark round of
`static_generate` stage by stage.

The fused round is one function (one CUDA graph when compiled), so no timer can look inside it. The profile runs the
same round split at its stage boundaries instead: each stage is a function of its own on the round's state buffers
(one CUDA graph each when compiled) and is timed with CUDA events (the wall clock on the CPU) and, on CUDA, by
torch.profiler (GPU time alone). The fused round is then timed the same way on the same decode, so the report shows
both the split and what a decode really pays.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import PreTrainedModel

from ..devices import synchronize
from ..models import DSparkDraftModel
from ..models.modeling import greedy_selector
from .cuda_graphs import compiled_round
from .fused_markov import draft_tokens
from .static_loop import StaticRound, fast_path, start_dspark_rounds

# `RoundProfiler`'s parts that the fast path has (it has no scheduler: its γ is fixed), in round order
ROUND_STAGES = ("draft_backbone", "markov_sampling", "verify_forward", "verification", "bookkeeping")


@dataclass
class StaticRoundProfile:
    """Milliseconds per round: `stages` (each of `ROUND_STAGES`, the round run split), `split_round` (their sum),
    `fused_round` (the fused round function, as `static_generate` runs it); `tokens`: what the profiled rounds
    decoded after the prompt (the split rounds, then the fused ones: one greedy continuation); `accepted`: drafts
    accepted in each of those rounds. `gpu` (CUDA only), from torch.profiler, per round: the device time of each stage
    and of the fused round (`fused`), without the gaps in which the GPU waited for the host, and the summed self time
    of all kernels while the split and the fused rounds ran (`kernels_split`, `kernels_fused`)."""

    stages: dict[str, float]
    split_round: float
    fused_round: float
    rounds: int
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    gpu: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(stages_ms=self.stages, split_round_ms=self.split_round, fused_round_ms=self.fused_round,
                    rounds=self.rounds, tau=1 + sum(self.accepted) / max(1, len(self.accepted)),
                    gpu_kernel_ms=self.gpu or None)


class _Timer:
    """Elapsed milliseconds of calls: CUDA events on a CUDA device (no synchronisation until `total`), else the
    wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {}

    def time(self, name: str, fn: Callable[[], None]) -> None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self.spans.setdefault(name, []).append((start, end))
        else:
            started = time.perf_counter()
            fn()
            self.spans.setdefault(name, []).append(1e3 * (time.perf_counter() - started))

    def total(self, name: str) -> float:
        spans = self.spans.get(name, [])
        if self.cuda:
            torch.cuda.synchronize()
            return sum(start.elapsed_time(end) for start, end in spans)
        return sum(spans)


class _SplitRound:
    """The greedy round of `StaticRound` as one function per stage, passing results through buffers (CUDA graphs
    keep their addresses), each compiled like the fused round when `compile` is set. Construction runs one round
    eagerly, which allocates the buffers."""

    def __init__(self, rounds: StaticRound, compile: bool | dict):
        self.rounds = rounds
        self.buffers: dict[str, torch.Tensor] = {}
        stages = dict(draft_backbone=self._draft_backbone, markov_sampling=self._markov_sampling,
                      verify_forward=self._verify_forward, verification=self._verification,
                      bookkeeping=self._bookkeeping)
        self.stages = stages
        self.run()
        if compile:  # (direct graphs or the trees, as `DSPARK_CUDA_GRAPHS` has the fused round run)
            device = rounds.target.device
            self.stages = {name: compiled_round(fn, compile, device) for name, fn in stages.items()}

    def _keep(self, **tensors: torch.Tensor) -> None:
        for name, tensor in tensors.items():
            kept = self.buffers.get(name)
            if kept is None:
                kept = self.buffers[name] = torch.empty_like(tensor)
                torch._dynamo.mark_static_address(kept)
            kept.copy_(tensor)

    def _draft_backbone(self) -> None:
        r = self.rounds
        hidden, base_logits = r.draft_backbone(r.anchor, r.features, r.context_start, r.position)
        self._keep(hidden=hidden, base_logits=base_logits)

    def _markov_sampling(self) -> None:
        b = self.buffers
        drafts, _ = draft_tokens(self.rounds.drafter, self.rounds.anchor, b["hidden"], b["base_logits"],
                                 greedy_selector)
        self._keep(drafts=drafts)

    def _verify_forward(self) -> None:
        logits, features = self.rounds.verify_forward(self.rounds.anchor, self.buffers["drafts"], self.rounds.position)
        self._keep(logits=logits, step_features=features)

    def _verification(self) -> None:
        b = self.buffers
        host, anchor, position = self.rounds.greedy_verification(b["drafts"], b["logits"], self.rounds.position)
        self._keep(host=host, next_anchor=anchor, next_position=position)

    def _bookkeeping(self) -> None:
        b = self.buffers
        self.rounds.advance(b["host"], b["next_anchor"], b["step_features"], b["next_position"])

    def run(self) -> None:
        for stage in self.stages.values():
            stage()


def _kernel_ms(calls: list[tuple[str, Callable[[], None]]], rounds: int, device: torch.device,
               window: str) -> dict[str, float]:
    """GPU time per round of each named call (0 without a GPU): `rounds` rounds of `calls` under torch.profiler, each
    call in a `record_function` range, whose device time covers the kernels it launches (those of a CUDA-graph replay
    too); `kernels_<window>`: the summed self time of every kernel in the window."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(rounds):
            for name, call in calls:
                with record_function(f"dspark_stage::{name}"):
                    call()
        synchronize(device)
    ms: dict[str, float] = {}
    for event in prof.key_averages():
        if event.key.startswith("dspark_stage::"):
            ms[event.key.split("::", 1)[1]] = event.device_time_total / 1e3 / rounds
        elif event.device_type == torch.autograd.DeviceType.CUDA:
            key = f"kernels_{window}"
            ms[key] = ms.get(key, 0.0) + event.self_device_time_total / 1e3 / rounds
    return ms


@torch.no_grad()
def profile_static_round(
    target: PreTrainedModel,
    drafter: DSparkDraftModel,
    input_ids: torch.LongTensor,
    rounds: int = 32,
    *,
    warmup: int = 3,
    compile: bool | dict = False,
    attention: str = "auto",
    fuse_projections: bool | None = None,
) -> StaticRoundProfile:
    """Milliseconds per greedy DSpark round of `static_generate`'s fast path, per stage (`ROUND_STAGES`).

    Decodes after `input_ids` [1, L] as `static_generate` does (after a short prompt the first round runs eagerly:
    `static_loop.PromptState`), then: one eager split round, then `warmup` + `rounds` split rounds (the last `rounds`
    timed with CUDA events, or the wall clock on the CPU) and, on CUDA, `rounds` more under torch.profiler; then the
    same with the fused round. eos does not stop it. `compile`, `attention` and `fuse_projections` as in
    `static_generate` (pass the same values to profile what it runs). Event times include the GPU's waits for the host
    where the host launches more slowly than the GPU runs (small models); `StaticRoundProfile.gpu` has the kernel time
    alone. The split round's stages run back to back; its sum exceeds the fused round by the launch gaps between the
    stages' graphs and the fusion across stage boundaries that the split prevents."""
    if drafter is None:
        raise ValueError("profile_static_round() profiles DSpark rounds and needs a drafter; a plain step is one "
                         "target forward (time static_generate(target, None, ...) for it).")
    width, device = drafter.config.num_draft_slots + 1, target.device
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"profile_static_round() profiles one prompt [1, L]; got shape {tuple(input_ids.shape)}.")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got {rounds} and {warmup}.")
    phases = 2 if device.type == "cuda" else 1  # timed rounds, then (CUDA) profiled rounds, split and fused each
    recorded = 1 + 2 * (warmup + phases * rounds)  # the split round's eager first round, the split and fused rounds
    max_length = input_ids.shape[1] + (recorded + 3) * width  # + a first round run before them, + a margin
    with fast_path(target, drafter, max_length, compile, False, attention, fuse_projections) as state:
        prompt = state.prefill(input_ids.to(device))
        first = prompt.logits.argmax(dim=-1)
        position = torch.tensor(input_ids.shape[1], device=device)
        eager_round = start_dspark_rounds(state, first, prompt, position)
        timer, gpu = _Timer(device), {}
        with state.verifier.tapping():
            split = _SplitRound(state, compile)
            for window, calls in (("split", list(split.stages.items())), ("fused", [("fused", state.compiled)])):
                for index in range(warmup + rounds):
                    for name, call in calls:
                        if index >= warmup:
                            timer.time(name, call)
                        else:
                            call()
                if timer.cuda:
                    gpu.update(_kernel_ms(calls, rounds, device, window))
        stages = {name: timer.total(name) / rounds for name in ROUND_STAGES}
        fused = timer.total("fused") / rounds
        tokens, accepted = [int(first)], []
        rows = ([eager_round[0]] if eager_round is not None else []) + state.record[:recorded].tolist()
        for count, *targets in rows:
            tokens += targets[: count + 1]
            accepted.append(count)
    return StaticRoundProfile(stages=stages, split_round=sum(stages.values()), fused_round=fused, rounds=rounds,
                              tokens=tokens, accepted=accepted, gpu=gpu)
