"""Diagnostics behind the serving benchmark's noise and costs (code50m fixture; timing only).

    PYTHONPATH=src python benchmarks/serving_diagnostics.py host-phases OUT.json
    PYTHONPATH=src python benchmarks/serving_diagnostics.py plain-rounds [--concurrency 256] > OUT.txt

host-phases: does the host change speed over time? Ten rows per setting, each timing a pure Python loop
(`sum(range(300000))`), 2000 in-place adds on a 1-element device tensor, and one DSparkEngine cell at c = 1 (64 new
tokens) with no speculation and with fixed γ = 7 (median round ms), under torch's default threads, one thread, and one
thread pinned to core 2 (`results/host_phases_h200.json`).
plain-rounds: do the plain rounds of the hardware-aware engine (a guard that never drafts: target features are still
captured for the drafter) cost more than no-speculation rounds? Cells of 2c requests (32-96 new tokens) alternate
between the two engines, then one more of each runs under cProfile
(`results/serving_diagnostics/plain_round_profile_h200.txt`).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
import serving  # noqa: E402
from common import environment  # noqa: E402

from dspark_hf.devices import synchronize  # noqa: E402
from dspark_hf.scheduling import SpeculationGuard, SPSTable  # noqa: E402
from dspark_hf.serving import DSparkEngine  # noqa: E402

SETTINGS = {"nospec": dict(policy="none"), "fixed7": dict(policy="fixed", gamma=7),
            "ha_plain": dict(policy="hardware_aware")}


class NeverDraft(SpeculationGuard):
    """A guard that runs every round plain."""

    def should_draft(self, batch_size: int) -> bool:
        return False


def make_engine(kind: str, target, drafter, concurrency: int) -> DSparkEngine:
    """The benchmark's engine for `kind`; `ha_plain` is the hardware-aware engine with a guard that never drafts."""
    options = dict(speculation_guard=NeverDraft()) if kind == "ha_plain" else {}
    return serving.make_engine(target, drafter, concurrency, SETTINGS[kind], SPSTable([1, 2048], [150.0, 140.0]),
                               **options)


def cell(engine: DSparkEngine, prompts, concurrency: int, args, profile: cProfile.Profile | None = None):
    """The benchmark's cell (`serving.drive`), optionally under `profile`; returns (seconds, the round log)."""
    with torch.inference_mode(), profile if profile is not None else contextlib.nullcontext():
        _, seconds = serving.drive(engine, prompts, concurrency, args)
    return seconds, engine.round_log


def median_round_ms(log: list[dict]) -> float:
    return round(1e3 * statistics.median(entry["seconds"] for entry in log[2:]), 2)


def host_phases(out: str, device: str) -> None:
    target, drafter, prompts = serving.load_models("code50m", torch.bfloat16, device)
    one_request = argparse.Namespace(max_new_tokens=64, requests_per_slot=1, length_spread=0.0)
    counter = torch.zeros(1, device=device)
    began = time.perf_counter()

    def python_loop() -> float:
        start = time.perf_counter()
        sum(range(300000))
        return round(1e3 * (time.perf_counter() - start), 2)

    def launches() -> float:
        synchronize(counter.device)
        start = time.perf_counter()
        for _ in range(2000):
            counter.add_(1)
        synchronize(counter.device)
        return round(1e3 * (time.perf_counter() - start), 2)

    def engine_cell(kind: str) -> float:
        return median_round_ms(cell(make_engine(kind, target, drafter, 1), prompts, 1, one_request)[1])

    report = dict(environment=environment(), threads_default=torch.get_num_threads(), cpu_count=os.cpu_count())
    engine_cell("nospec"), engine_cell("fixed7")  # warm-up

    def series(label: str) -> None:
        report[label] = []
        for _ in range(10):
            row = dict(t=round(time.perf_counter() - began, 2), py=python_loop(), launch=launches(),
                       nospec=engine_cell("nospec"), fixed7=engine_cell("fixed7"))
            report[label].append(row)
            print(label, row, flush=True)

    series("threads_default")
    torch.set_num_threads(1)
    series("threads_1")
    os.sched_setaffinity(0, {min(2, os.cpu_count() - 1)})
    series("affinity_core2")
    Path(out).write_text(json.dumps(report, indent=1) + "\n")


def plain_rounds(concurrency: int, device: str) -> None:
    target, drafter, prompts = serving.load_models("code50m", torch.bfloat16, device)
    args = argparse.Namespace(max_new_tokens=64, requests_per_slot=2, length_spread=0.5)  # 32-96 new tokens

    def run(kind: str, cell_args, profile: cProfile.Profile | None = None) -> None:
        seconds, log = cell(make_engine(kind, target, drafter, concurrency), prompts, concurrency, cell_args, profile)
        print(f"{kind} {concurrency} {seconds:.2f}s rounds {len(log)} median {median_round_ms(log)} ms "
              f"width {statistics.fmean(entry['width'] for entry in log):.0f}", flush=True)

    for kind in ("nospec", "ha_plain"):  # warm-up, as the benchmark's: 8 new tokens
        run(kind, argparse.Namespace(**{**vars(args), "max_new_tokens": 8}))
    for kind in ("nospec", "ha_plain") * 2:
        run(kind, args)
    for kind in ("nospec", "ha_plain"):
        profile = cProfile.Profile()
        run(kind, args, profile)
        for sort, restriction in (("tottime", 25), ("cumulative", ("dspark_hf", 30))):
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text).sort_stats(sort)
            stats.print_stats(*restriction) if isinstance(restriction, tuple) else stats.print_stats(restriction)
            print(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    phases = commands.add_parser("host-phases")
    phases.add_argument("out")
    plain = commands.add_parser("plain-rounds")
    plain.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.command == "host-phases":
        host_phases(args.out, args.device)
    else:
        plain_rounds(args.concurrency, args.device)


if __name__ == "__main__":
    main()
