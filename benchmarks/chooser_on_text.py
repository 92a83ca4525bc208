"""The static engine's hardware-aware chooser on real text with the GPU's round times: CPU only.

    PYTHONPATH=src:benchmarks python benchmarks/chooser_on_text.py --concurrency 4 --times 0.326 0.49 0.517 0.566

runs the code50m fixture and its trained drafter (float32, CPU) on HumanEval prompts as `benchmarks/serving.py
--static` does (greedy, the same request lengths, one engine per policy kept across the warm-up run and the timed
runs), but each round's time is not the CPU's: it is the given GPU round time of its width (plain, γ = 1, 3, 7) times
log-normal noise, and the chooser is told that time. A policy's tokens per second are its tokens over the sum of
those times. So acceptance is the real drafter's on real text (its bursts, the requests turning over) while the
round times are the GPU's, and one can see whether the chooser's mix of widths pays against each fixed width
without a GPU. Admission and the host's work between rounds are left out.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import torch

from common import environment
from serving import add_requests, load_models, request_count, request_lengths

from dspark_hf.scheduling.round_widths import AFTER_PLAIN, acceptance_state
from dspark_hf.serving import DSparkEngine

WIDTHS = (0, 1, 3, 7)
POLICIES = ("fixed_3", "fixed_7", "hardware_aware")


class GpuClock:
    """Gives a static engine's rounds `times[width]` seconds × log-normal noise of `spread` (each round's width from
    its round log), adds them up, and tells its chooser, if any, those times instead of the CPU's."""

    def __init__(self, engine: DSparkEngine, times: dict[int, float], spread: float, seed: int):
        self.engine, self.times, self.spread = engine, times, spread
        self.random = random.Random(seed)
        self.seconds, self.widths, self.last = 0.0, Counter(), None
        record_last_round = engine.runner._record_last_round  # (which records nothing when no round is pending)
        engine.runner._record_last_round = lambda _cpu_seconds, _overhead=None: record_last_round(self.last)

    def step(self) -> None:
        """One engine round, timed by its width."""
        logged = len(self.engine.round_log)
        self.engine.step()
        if len(self.engine.round_log) > logged:
            width = max(self.engine.round_log[-1]["verify"])
            self.last = self.times[width] * math.exp(self.random.gauss(0.0, self.spread))
            self.seconds += self.last
            self.widths[width] += 1


def serve(engine: DSparkEngine, clock: GpuClock, prompts, concurrency: int, args) -> dict:
    """One run of `serving.add_requests`'s requests, each round timed by `clock`: tokens, GPU seconds, tokens per
    second, rounds per width, each request's drafts verified and accepted per round ("requests") and (with a chooser)
    each round's (width, accepted drafts, rows, reason, rates)."""
    clock.seconds, clock.widths = 0.0, Counter()
    engine.round_log.clear()
    handles = add_requests(engine, prompts, concurrency, args)
    started = time.perf_counter()
    while engine.has_unfinished():
        clock.step()
    tokens = sum(len(handle.tokens) for handle in handles)
    result = dict(tokens=tokens, gpu_seconds=clock.seconds, tokens_per_second=tokens / clock.seconds,
                  rounds=dict(sorted(clock.widths.items())), cpu_seconds=time.perf_counter() - started,
                  requests=[(handle.drafted, handle.accepted) for handle in handles])
    if engine.runner.chooser is not None:
        result["log"] = [(max(entry["verify"]), sum(entry["accepted"]), len(entry["accepted"]), *entry["choice"])
                         for entry in engine.round_log]
    return result


def tokens_per_round(accepted: list[int], width: int, renewal: bool) -> float:
    """Tokens a row commits per round at `width`, estimated from rows' accepted drafts `accepted` in rounds of a wider
    width: as measured (mean of min(k, width) + 1), or by renewal (each observation weighted by the k + 1 tokens its
    own round committed: the text positions it stands for, if acceptance holds across them; then the harmonic mean of
    min(k, width) + 1 over positions)."""
    if not renewal:
        return 1 + sum(min(k, width) for k in accepted) / len(accepted)
    return sum(k + 1 for k in accepted) / sum((k + 1) / (min(k, width) + 1) for k in accepted)


def next_round_by_state(requests: list[tuple[list[int], list[int]]]) -> dict[int, dict[str, float]]:
    """Per `acceptance_state` of a request's round: how many rounds followed one in that state, and the drafts
    accepted in them on average (from each request's drafts verified and accepted per round)."""
    following: dict[int, list[int]] = {}
    for drafted, accepted in requests:
        state = AFTER_PLAIN
        for width, count in zip(drafted, accepted):
            if width:
                following.setdefault(state, []).append(count)
            state = acceptance_state(width, count)
    return {state: dict(rounds=len(counts), accepted=sum(counts) / len(counts))
            for state, counts in sorted(following.items())}


def acceptance_by_width(engines: dict[str, DSparkEngine], clocks: dict, prompts, args) -> dict:
    """`--acceptance-by-width`: one run of each fixed width; per width, each row-round's accepted drafts summarised,
    the tokens per round of every narrower width as estimated from its rounds (as measured, and by renewal), and the
    drafts accepted after a round in each acceptance state (`next_round_by_state`)."""
    report = {}
    for policy, engine in engines.items():
        result = serve(engine, clocks[policy], prompts, args.concurrency, args)
        accepted = [count for entry in engine.round_log for count in entry["accepted"]]
        width = int(policy.removeprefix("fixed_"))
        report[policy] = dict(row_rounds=len(accepted), tokens_per_round=1 + sum(accepted) / len(accepted),
                              estimated_from_these_rounds={
                                  str(narrower): dict(as_measured=tokens_per_round(accepted, narrower, False),
                                                      renewal=tokens_per_round(accepted, narrower, True))
                                  for narrower in WIDTHS if 0 < narrower < width},
                              next_round_by_state=next_round_by_state(result["requests"]))
        print(policy, json.dumps(report[policy]), flush=True)
    return report


def make(target, drafter, policy: str, concurrency: int, longest: int) -> DSparkEngine:
    gamma = int(policy.removeprefix("fixed_")) if policy.startswith("fixed_") else None
    return DSparkEngine(target, drafter, static=True, policy="fixed" if gamma is not None else "hardware_aware",
                        gamma=gamma, max_batch_size=concurrency, max_model_len=longest + 8,
                        static_graph_batch_sizes={concurrency}, admission_batch=1)


def add_cell_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPU's round times and the cell's requests, as `benchmarks/chooser_on_field.py` takes them too."""
    parser.add_argument("--times", type=float, nargs=4, default=[0.326, 0.49, 0.517, 0.566],
                        help="GPU round milliseconds of plain, γ = 1, 3 and 7 rounds (default: the H100's at c = 4)")
    parser.add_argument("--spread", type=float, default=0.02, help="log-normal noise on each round time")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--length-spread", type=float, default=0.5)
    parser.add_argument("--requests-per-slot", type=int, default=16)
    parser.add_argument("--min-requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=4)
    add_cell_arguments(parser)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--chooser", nargs="*", default=[], metavar="NAME=VALUE",
                        help="RoundWidthChooser attributes to set on the hardware-aware engine, e.g. decay=0.995")
    parser.add_argument("--acceptance-by-width", action="store_true",
                        help="instead: one run of each fixed policy, and each narrower width's tokens per round as "
                             "estimated from its rounds (as measured, and by renewal)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    target, drafter, prompts = load_models("code50m", torch.float32, "cpu")
    count = request_count(args.concurrency, args)
    longest = max(map(len, prompts)) + max(request_lengths(count, args))
    times = {width: ms / 1e3 for width, ms in zip(WIDTHS, args.times)}
    engines = {policy: make(target, drafter, policy, args.concurrency, longest) for policy in args.policies}
    chooser = engines["hardware_aware"].runner.chooser if "hardware_aware" in engines else None
    for setting in args.chooser:
        name, value = setting.split("=")
        setattr(chooser, name, type(getattr(chooser, name))(float(value)))
    clocks = {policy: GpuClock(engine, times, args.spread, seed=index)
              for index, (policy, engine) in enumerate(engines.items())}
    if args.acceptance_by_width:
        fixed = {policy: engine for policy, engine in engines.items() if policy.startswith("fixed_")}
        report = acceptance_by_width(fixed, clocks, prompts, args)
        if args.out:
            args.out.write_text(json.dumps(dict(concurrency=args.concurrency, widths=report, environment=environment(),
                                                command=vars(args) | {"out": str(args.out)}), indent=1) + "\n")
        return
    runs = {policy: [] for policy in args.policies}
    for repeat in range(-1, args.repeats):
        for policy, engine in engines.items():
            run_args = args if repeat >= 0 else argparse.Namespace(**{**vars(args), "max_new_tokens": 8})
            result = serve(engine, clocks[policy], prompts, args.concurrency, run_args)
            del result["requests"]
            print(f"run {repeat} {policy}: {json.dumps({k: v for k, v in result.items() if k != 'log'})}", flush=True)
            if repeat >= 0:
                runs[policy].append(result)
    report = dict(concurrency=args.concurrency, times_ms=dict(zip(WIDTHS, args.times)), spread=args.spread,
                  runs=runs, environment=environment(), command=vars(args) | {"out": str(args.out)})
    fixed = [sum(run["tokens_per_second"] for run in runs[policy]) for policy in runs if policy != "hardware_aware"]
    if "hardware_aware" in runs and fixed:
        best = max(fixed)
        report["hardware_aware_over_best_fixed"] = sum(run["tokens_per_second"]
                                                       for run in runs["hardware_aware"]) / best
        print("hardware-aware / best fixed:", report["hardware_aware_over_best_fixed"])
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
