"""Why are the hardware-aware static engine's γ = 7 rounds slower than fixed γ = 7's? GPU, a few minutes.

    PYTHONPATH=src python benchmarks/round_width_overhead.py --concurrency 2 16 128 --repeats 3

In the serving sweep (`serving_static_final_chooser_h200.json.gz`) the hardware-aware engine's rounds that verified
7 drafts took 1-3 % longer (median draft + verify time) than the fixed γ = 7 engine's, at every concurrency, though
both replay the same graph. Five engines on the same requests, stepped in turn in a new order every sweep, tell apart
what differs between them:

- `fixed_7`: compiled for γ = 7 only (as in the sweep);
- `fixed_7_all_widths`: the same, with the graphs of widths 0, 1, 3 and 7 compiled too (the hardware-aware engine's
  set), but still running 7 only;
- `hardware_aware_pinned_7`: the hardware-aware engine with its chooser's choice pinned to 7 (it still records);
- `hardware_aware_pinned_7_no_record`: the same, and its chooser's `record` does nothing;
- `hardware_aware`: as in the sweep.

The answer (`results/round_width_overhead_h200.json`, measured before the fix): mostly the chooser's host time. Its
calls took 6-8 µs to choose and 18-31 µs to record, on average per round on the H200 machine, spent between one
round's launch and the next: 2-3 % of a round at c = 2 and 16, 1.3 % at c = 128, where `hardware_aware`'s rounds
were 1.1-4.2 % and 0.8-1.5 % longer than `fixed_7`'s. The extra graphs cost nothing (`fixed_7_all_widths`: -1.6 to
+1.5 %); pinned without `record` the engine was within 0.7 % of `fixed_7` at c = 16 and 128 (at c = 2 the runs
scatter by ±2 %). Since then the static engine records a round during the next one, while the device runs it, and
chooses the round after then too (`StaticRows.step`).

`--width W` (3, 1 or 0) asks the same of the rounds of W drafts (0: plain rounds), where the serving cells of
2026-12-07 still found the hardware-aware engine's rounds 3-11 µs longer than the fixed engine's (docs/serving.md),
with other engines: `fixed_W` (W = 0: the engine without speculation), `fixed_W_replica` (a second engine just like
it: how far two engines of one policy differ), `hardware_aware_pinned_W`, `hardware_aware_pinned_W_no_refine` (its
chooser's `state_rows` 0: no `refine` before a round of few rows) and `hardware_aware`:

    PYTHONPATH=src python benchmarks/round_width_overhead.py --width 3 --concurrency 1 --repeats 3 --round-parts

On an H100 (2026-12-07, `results/round_width_overhead_parts_w3_c1*_h100.json`) the hardware-aware engine's rounds of 3
drafts at c = 1 spent 2-3 µs more host time before the launch than fixed γ = 3's and about as much after it (its
choice pinned too), and choosing for itself 3-5 µs more in the launch call and 4-9 µs more on the device;
its plain rounds at c = 128 took 0.7-1.9 % longer than no speculation's
(`results/round_width_overhead_w0_c128_h100.json`; a second engine without speculation -0.2 to +0.9 %).
A second H100 call the same day: at c = 128 (`results/round_width_overhead_parts_w0_c128_wide_h100.json`) caches as
long as a speculative engine's cost no speculation nothing (`fixed_0_wide`: 460.4 µs on the device against 461.7),
while the hardware-aware engine pinned to plain rounds, with or without `record`, spent 468.0-470.3 µs there, with the
same launch call (33 µs) and 0.7 µs more host time before it: its plain rounds (bare, in a long run) replay the graph
of plain decoding, yet take 1.4-1.9 % longer on the device. At c = 1 (`..._parts_w3_c1_choosing_h100.json`) `choose`'s
host work costs nothing (`hardware_aware_pinned_3_choosing_no_refine`: 489.2 µs on the device against 488.0 pinned and
fixed γ = 3's 488.5), while choosing for itself (its measuring and refresh rounds of other widths among its rounds of 3)
its rounds of 3 took 8 µs more on the device and 2 µs more in the launch. `--profile-rounds` times each engine's
kernels alone (`torch.profiler`); at c = 128 (a third call, `results/round_width_overhead_profile_w0_c128_h100.json`)
the two engines' plain rounds ran the same kernels, as often, for 378.4 and 375.1 µs a round (the hardware-aware one's
attention 4 µs faster), and in that call the hardware-aware engine's rounds were 0.8 % faster, not slower:

    PYTHONPATH=src python benchmarks/round_width_overhead.py --width 0 --concurrency 128 --repeats 1 \
        --profile-rounds 40 --engines fixed_0_wide hardware_aware_pinned_0

So the kernels are not what differs, but the rest of a round's device time: at c = 128 the second call's 460-470 µs
less these kernel sums leave 85-90 µs of launch latency and gaps between kernels. `--queue-cycles` keeps the device
busy while the graph is launched, so that `device` leaves the launch out (not run yet).

Reported per engine and concurrency: the median draft + verify time of its rounds that verified W drafts with every
row running, no admission and no drafter-context upkeep (the engine's `round_log` `step_seconds`, which include the
host work before the round's launch and after its synchronisation), over `--repeats` runs after a warm-up run, their
ratio to the first engine's, and the mean host time of the `hardware_aware` chooser's calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment  # noqa: E402
from serving import load_models, step_in_turn  # noqa: E402

from dspark_hf.generation.static_rows import cache_capacity  # noqa: E402
from dspark_hf.serving import DSparkEngine  # noqa: E402


def engine_names(width: int = 7) -> tuple[str, ...]:
    """The engines compared by default for rounds of `width` drafts (`--width`; 0: plain rounds, where `fixed_0` is
    the engine without speculation); `--engines` names others (`build`)."""
    if width == 7:  # (the first experiment's set)
        return ("fixed_7", "fixed_7_all_widths", "hardware_aware_pinned_7", "hardware_aware_pinned_7_no_record",
                "hardware_aware")
    return (f"fixed_{width}", f"fixed_{width}_replica", f"hardware_aware_pinned_{width}",
            f"hardware_aware_pinned_{width}_no_refine", "hardware_aware")


def build(name: str, target, drafter, concurrency: int, max_model_len: int, width: int = 7) -> DSparkEngine:
    """The engine `name`: `fixed_W` (W = 0: without speculation), with `_replica` a second one just like it, with
    `_wide` (W = 0) its KV caches as long as the speculative engines' (their drafter context's reach), with
    `_all_widths` the graphs of widths 0, 1, 3 and 7 compiled too; `hardware_aware_pinned_W`, its chooser's choice
    pinned to W, with `_choosing` (its chooser's `choose` still runs), `_no_record` (its chooser records nothing)
    and / or `_no_refine` (`state_rows` 0); or `hardware_aware` (its chooser's calls timed: `chooser_call_us`), or
    under any other name that starts so, untimed (with `_no_refine` as above)."""
    fixed = name.startswith(f"fixed_{width}")
    policy = "hardware_aware" if not fixed else "fixed" if width else "none"
    if name.endswith("_wide") and policy == "none":  # (a speculative engine's caches also hold its drafter's reach)
        span = drafter.config.num_draft_slots + 1
        max_model_len += cache_capacity(0, span, True, 0) - cache_capacity(0, 1, False, 0)
    engine = DSparkEngine(target, drafter if policy != "none" else None, static=True, policy=policy,
                          gamma=width if policy == "fixed" else None, max_batch_size=concurrency,
                          max_model_len=max_model_len, static_graph_batch_sizes={concurrency},
                          static_admission_rows=16)
    engine.warm_up(widths=(0, 1, 3, 7) if name.endswith("_all_widths") else None, progress=False)
    chooser = engine.runner.chooser
    if name.startswith(f"hardware_aware_pinned_{width}"):
        choose = chooser.choose  # (with `_choosing` still called, its host work done and its answer dropped)
        chooser.choose = ((lambda rows, requests=None: (choose(rows, requests), width)[1]) if "_choosing" in name
                          else lambda rows, requests=None: width)
    if "_no_record" in name:
        chooser.record = lambda *args, **kwargs: None
    if "_no_refine" in name:
        chooser.state_rows = 0
    if name == "hardware_aware":
        for method in CHOOSER_SECONDS:
            setattr(chooser, method, timed(getattr(chooser, method), CHOOSER_SECONDS[method]))
    return engine


CHOOSER_SECONDS: dict[str, list[float]] = {"choose": [], "record": [], "prepare": [], "refine": []}


def timed(function, seconds: list[float]):
    def call(*args, **kwargs):
        started = time.perf_counter()
        result = function(*args, **kwargs)
        seconds.append(time.perf_counter() - started)
        return result
    return call


class RoundParts:
    """`--round-parts`: for each round of `width` drafts of an engine's full rows with no drafter-context upkeep, the
    host's µs from `StaticRows.step`'s start to the graph's launch, the launch call's, the device's for the graph
    (CUDA events around the launch) and the host's from the launch's return to the step's end (the device's remaining
    work, the synchronisation, the host's work after it). The device's time then also holds the part of the launch
    call before its first kernel reaches the idle device; with `queue_cycles` the device first spins that many
    cycles (`torch.cuda._sleep`), so that the whole graph is queued before its start is timed and `device` is its
    execution alone (`--queue-cycles`; the spin lengthens every round alike)."""

    PARTS = ("before_launch", "launch", "device", "after_launch")

    def __init__(self, engine: DSparkEngine, width: int, concurrency: int, queue_cycles: int = 0):
        runner, rounds = engine.runner, engine.runner.rounds
        self.samples: list[tuple[float, ...]] = []
        step, greedy_round = runner.step, rounds.greedy_round
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks: dict[str, float] = {}

        def timed_round(verify: int, bare: bool = False):
            graph = greedy_round(verify, bare)

            def launch() -> None:
                marks["launch"] = time.perf_counter()
                if queue_cycles:
                    torch.cuda._sleep(queue_cycles)
                begin.record()
                graph()
                end.record()
                marks["launched"], marks["verify"] = time.perf_counter(), verify
            return launch

        def timed_step():
            marks.clear()
            entered = time.perf_counter()
            committed = step()
            left = time.perf_counter()
            if marks.get("verify") == width and not runner.upkeep and len(runner.occupied) == concurrency:
                self.samples.append((marks["launch"] - entered, marks["launched"] - marks["launch"],
                                     1e-3 * begin.elapsed_time(end), left - marks["launched"]))
            return committed

        runner.step, rounds.greedy_round = timed_step, timed_round

    def medians_us(self) -> dict[str, float]:
        return {part: round(1e6 * statistics.median(values), 2)
                for part, values in zip(self.PARTS, zip(*self.samples))} if self.samples else {}


def kernel_times(engine: DSparkEngine, prompts, concurrency: int, new_tokens: int, rounds: int, top: int = 12
                 ) -> dict:
    """`--profile-rounds`: `engine` alone serves `concurrency` requests of `new_tokens` (admitted in its first step,
    unprofiled), up to `rounds` rounds of which are profiled (fewer if they finish sooner: choose `new_tokens` so that
    they do not); its device kernels' µs and calls per profiled round in all and, for the `top` costliest, by name
    (calls and µs per round), from `torch.profiler` (CUPTI lists the kernels of CUDA graph replays; on the CPU: the
    operators' own CPU time)."""
    for i in range(concurrency):
        engine.add_request(prompts[i % len(prompts)], max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.step()
    cuda = engine.target.device.type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    profiled = 0
    with torch.profiler.profile(activities=[activity]) as profiler:
        while profiled < rounds and engine.step():
            profiled += 1
    while engine.has_unfinished():
        engine.step()
    if not profiled:
        raise SystemExit("--profile-rounds: the requests finished in their first round; give more --new-tokens")
    kernels = [(event.key, event.count, event.self_device_time_total if cuda else event.self_cpu_time_total)
               for event in profiler.key_averages()
               if event.device_type == (torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU)]
    kernels.sort(key=lambda kernel: -kernel[2])
    return dict(rounds=profiled, device_us_per_round=round(sum(kernel[2] for kernel in kernels) / profiled, 2),
                kernels_per_round=round(sum(kernel[1] for kernel in kernels) / profiled, 2),
                kernels={name[:90]: [round(count / profiled, 2), round(total / profiled, 2)]
                         for name, count, total in kernels[:top]})


def run(engines: dict[str, DSparkEngine], prompts, concurrency: int, new_tokens: int, seed: int,
        width: int = 7) -> dict:
    """One run: `concurrency` requests per engine, stepped in turn (`serving.step_in_turn`); each engine's times (ms)
    of its rounds that verified `width` drafts with every row running, no admission and no drafter-context upkeep."""
    for engine in engines.values():
        engine.round_log.clear()
        for i in range(concurrency):
            engine.add_request(prompts[i % len(prompts)], max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    step_in_turn(engines, seed=seed)
    return {name: [1e3 * entry["step_seconds"] for entry in engine.round_log
                   if max(entry["verify"]) == width and entry["batch"] == concurrency and not entry["admitted"]
                   and not entry["upkeep"]]
            for name, engine in engines.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=7, choices=(0, 1, 3, 7),
                        help="the rounds compared: of this many drafts (0: plain rounds, against no speculation)")
    parser.add_argument("--engines", nargs="+", help="the engines compared (see `build`), the first the reference; "
                                                     "default: the five of --width")
    parser.add_argument("--round-parts", action="store_true",
                        help="also time each round's parts (`RoundParts`; CUDA only; its timing adds host work)")
    parser.add_argument("--queue-cycles", type=int, default=0,
                        help="with --round-parts: the device spins this many cycles before each timed graph, so "
                             "that its time leaves out the launch's (`RoundParts`)")
    parser.add_argument("--profile-rounds", type=int, default=0,
                        help="then profile this many rounds of each engine alone (`kernel_times`; on the CPU: "
                             "its operators' CPU time)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=str(RESULTS / "round_width_overhead_h200.json"))
    args = parser.parse_args()
    target, drafter, prompts = load_models("code50m", getattr(torch, args.dtype), args.device)
    result = dict(benchmark="round_width_overhead", environment=environment(), settings=vars(args), cells={})
    out = Path(args.out)
    for concurrency in args.concurrency:
        for seconds in CHOOSER_SECONDS.values():
            seconds.clear()
        max_model_len = max(map(len, prompts)) + args.new_tokens + 8
        started = time.perf_counter()
        names = tuple(args.engines or engine_names(args.width))
        engines = {name: build(name, target, drafter, concurrency, max_model_len, args.width) for name in names}
        compile_seconds = time.perf_counter() - started
        run(engines, prompts, concurrency, 8, seed=0, width=args.width)  # warm-up run
        parts = {name: RoundParts(engine, args.width, concurrency, args.queue_cycles)
                 for name, engine in engines.items()} if args.round_parts else {}
        times = {name: [] for name in names}
        reference = names[0]
        for repeat in range(args.repeats):
            for name, values in run(engines, prompts, concurrency, args.new_tokens, seed=repeat + 1,
                                    width=args.width).items():
                times[name].append(statistics.median(values) if values else None)
        cell = dict(compile_seconds=round(compile_seconds, 1), median_step_ms_runs=times,
                    **{f"ratio_to_{reference}_runs": {name: [round(t / f, 4) if t and f else None
                                                             for t, f in zip(times[name], times[reference])]
                                                      for name in names}},
                    chooser_call_us={method: round(1e6 * statistics.fmean(seconds), 2)
                                     for method, seconds in CHOOSER_SECONDS.items() if seconds})
        cell["cache_columns"] = {name: engine.runner.width for name, engine in engines.items()}
        if parts:
            cell["round_parts_us"] = {name: timer.medians_us() for name, timer in parts.items()}
        if args.profile_rounds:
            cell["kernel_times"] = {name: kernel_times(engine, prompts, concurrency, args.new_tokens,
                                                       args.profile_rounds)
                                    for name, engine in engines.items()}
        result["cells"][str(concurrency)] = cell
        print(concurrency, json.dumps(cell), flush=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        del engines


if __name__ == "__main__":
    main()
