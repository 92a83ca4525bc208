"""What a plain round costs on the hardware-aware static engine against the no-speculation engine (GPU diagnostic).

    PYTHONPATH=src python benchmarks/plain_round_tax.py --model qwen3-4b-shape --concurrency 256 \
        --out benchmarks/results/plain_round_tax_h200.json

In the Qwen3-4B-shaped serving cells (`serving_static_4b_shared_h200.json`) the hardware-aware engine's plain rounds
(width 0) took 31 ms at c = 256 where the no-speculation engine's took 27.5 ms: the chooser then rated width 0 below
width 3 and never chose it, though no speculation was the fastest policy there. A plain round on a drafting engine
also appends each row's target features to its pending drafter context and, every `PENDING_ROUNDS` (γ + 1) rounds,
flushes that context into the drafter's cache. Two engines on the same requests, stepped in turn:

- `no_spec`: `DSparkEngine(static=True, policy="none")`, no drafter;
- `plain_with_context`: the hardware-aware engine with its width pinned to 0 (`StaticRows.set_policy(verify=0)`),
  its graphs of width 0 and the flush compiled.

Reported per engine: from torch.profiler over `--profile-rounds` rounds of each (CUPTI lists the kernels inside
CUDA-graph replays), the GPU time per round of the kernels whose total differs most, and where each round's
wall-clock time goes (`round_timeline`: host time before the device starts, device busy, idle gaps between its
kernels, time after its last kernel); then, over the requests' remaining rounds (all at full load), the median and
90th percentile of the draft + verify time (the round log's `step_seconds`; a flush falls into one round in
`PENDING_ROUNDS` (γ + 1)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment  # noqa: E402
from serving import load_models, step_in_turn  # noqa: E402

from dspark_hf.devices import synchronize  # noqa: E402
from dspark_hf.serving import DSparkEngine  # noqa: E402


def build(name: str, target, drafter, concurrency: int, max_model_len: int) -> DSparkEngine:
    speculative = name == "plain_with_context"
    engine = DSparkEngine(target, drafter if speculative else None, static=True,
                          policy="hardware_aware" if speculative else "none", max_batch_size=concurrency,
                          max_model_len=max_model_len, static_graph_batch_sizes={concurrency},
                          static_admission_rows=16)
    engine.warm_up(widths=[0] if speculative else None, progress=False)
    if speculative:
        engine.runner.set_policy(verify=0)
    return engine


ROUND = "dspark_round"  # the profiler's label of each profiled round (host side)


def profile_rounds(engine: DSparkEngine, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Over `rounds` of `engine`'s rounds (its requests queued and admitted): GPU ms per round of each kernel (none on
    the CPU), and `round_timeline` of them."""
    device = engine.target.device
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, *[ProfilerActivity.CUDA] * (device.type == "cuda")]) as prof:
        for _ in range(rounds):
            with record_function(ROUND):
                engine.step()
                synchronize(device)
    totals: dict[str, float] = defaultdict(float)
    windows, intervals = [], []
    for event in prof.events():
        span = (event.time_range.start, event.time_range.end)
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name != ROUND:
            totals[event.name[:90]] += event.device_time / 1e3 / rounds
            intervals.append(span)
        elif event.name == ROUND:
            windows.append(span)
    return dict(totals), round_timeline(windows, intervals)


def round_timeline(windows: list[tuple[float, float]], intervals: list[tuple[float, float]]) -> dict[str, float]:
    """Where rounds' wall-clock time goes, ms (medians over rounds), from the rounds' host `windows` and the device's
    kernel and copy `intervals` (µs, one clock; each interval belongs to the round it starts in): `before_device`
    (the round's start to its first device work: host work and launches), `device_busy` (the union of its
    intervals), `device_gaps` (idle time between its first and last device work), `after_device` (the rest: reading
    the round back, host bookkeeping). A round without device work counts wholly as `before_device`."""
    parts: dict[str, list[float]] = {name: [] for name in ("wall", "before_device", "device_busy", "device_gaps",
                                                              "after_device")}
    for start, end in sorted(windows):
        inside = sorted(span for span in intervals if start <= span[0] < end)
        busy, reach = 0.0, None  # (the union: intervals may overlap)
        for first, last in inside:
            if reach is None or first > reach:
                busy += last - first
                reach = last
            elif last > reach:
                busy += last - reach
                reach = last
        device_start = inside[0][0] if inside else end
        device_end = reach if inside else end
        for name, value in (("wall", end - start), ("before_device", device_start - start), ("device_busy", busy),
                            ("device_gaps", device_end - device_start - busy), ("after_device", end - device_end)):
            parts[name].append(value / 1e3)
    return {name: statistics.median(values) if values else 0.0 for name, values in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["code50m", "qwen3-4b-shape"], default="qwen3-4b-shape")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--profile-rounds", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(RESULTS / "plain_round_tax_h200.json"))
    args = parser.parse_args()
    target, drafter, prompts = load_models(args.model, torch.bfloat16, args.device)
    max_model_len = max(map(len, prompts)) + args.new_tokens + 8
    names = ("no_spec", "plain_with_context")
    with torch.inference_mode():
        engines = {name: build(name, target, drafter, args.concurrency, max_model_len) for name in names}
        for engine in engines.values():
            for i in range(args.concurrency):
                engine.add_request(prompts[i % len(prompts)], max_tokens=args.new_tokens, temperature=0.0,
                                   ignore_eos=True)
        for engine in engines.values():  # admission and the first round
            engine.step()
        profiled = {name: profile_rounds(engine, args.profile_rounds) for name, engine in engines.items()}
        kernels = {name: per_kernel for name, (per_kernel, _) in profiled.items()}
        for engine in engines.values():
            engine.round_log.clear()
        step_in_turn(engines, seed=0)  # the requests' remaining rounds, all at full load (equal lengths), timed
    report = dict(environment=environment(), model=args.model, concurrency=args.concurrency,
                  new_tokens=args.new_tokens, profile_rounds=args.profile_rounds, engines={})
    for name, engine in engines.items():
        full = [entry for entry in engine.round_log if entry["batch"] == args.concurrency]
        report["engines"][name] = dict(
            rounds=len(full), step_ms_median=1e3 * statistics.median(e["step_seconds"] for e in full),
            step_ms_p90=1e3 * statistics.quantiles([e["step_seconds"] for e in full], n=10)[-1],
            kernel_ms_per_round=sum(kernels[name].values()), timeline_ms=profiled[name][1])
    names_by_gap = sorted(set(kernels["no_spec"]) | set(kernels["plain_with_context"]),
                          key=lambda k: -abs(kernels["plain_with_context"].get(k, 0) - kernels["no_spec"].get(k, 0)))
    report["kernels_differing_most"] = [
        dict(kernel=k, no_spec_ms=round(kernels["no_spec"].get(k, 0), 4),
             plain_with_context_ms=round(kernels["plain_with_context"].get(k, 0), 4)) for k in names_by_gap[:20]]
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
