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
from common import environment, humaneval_prompts, load_target  # noqa: E402

import dspark_hf  # noqa: E402
from dspark_hf.devices import synchronize  # noqa: E402
from dspark_hf.scheduling import SpeculationGuard, SPSTable  # noqa: E402
from dspark_hf.serving import DSparkEngine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class NeverDraft(SpeculationGuard):
    """A guard that runs every round plain."""

    def should_draft(self, batch_size: int) -> bool:
        return False


def load(device: str):
    from transformers import AutoTokenizer

    target = load_target("code50m", torch.bfloat16, device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target.config._name_or_path)
    drafter = dspark_hf.DSparkDraftModel.from_pretrained(REPO / "drafters" / "code50m-dspark", dtype=torch.bfloat16)
    return target, drafter.to(device).eval(), [tokenizer(text)["input_ids"] for text in humaneval_prompts(64)]


def make_engine(kind: str, target, drafter, concurrency: int) -> DSparkEngine:
    if kind == "nospec":
        return DSparkEngine(target, None, max_batch_size=concurrency, seed=0, policy="none")
    if kind == "fixed7":
        return DSparkEngine(target, drafter, max_batch_size=concurrency, seed=0, policy="fixed", gamma=7)
    return DSparkEngine(target, drafter, max_batch_size=concurrency, seed=0, policy="hardware_aware",
                        sps_table=SPSTable([1, 2048], [150.0, 140.0]), speculation_guard=NeverDraft())


def cell(engine: DSparkEngine, prompts, lengths: list[int], profile: cProfile.Profile | None = None):
    """Runs the requests to the end; returns (seconds, the engine's round log)."""
    for i, n in enumerate(lengths):
        engine.add_request(prompts[i % len(prompts)], max_tokens=n, temperature=0.0, ignore_eos=True)
    synchronize(engine.target.device)
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    with torch.inference_mode():
        engine.run()
    if profile is not None:
        profile.disable()
    synchronize(engine.target.device)
    return time.perf_counter() - start, engine.round_log


def median_round_ms(log: list[dict]) -> float:
    return round(1e3 * statistics.median(entry["seconds"] for entry in log[2:]), 2)


def host_phases(out: str, device: str) -> None:
    target, drafter, prompts = load(device)
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
        return median_round_ms(cell(make_engine(kind, target, drafter, 1), prompts, [64])[1])

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
    target, drafter, prompts = load(device)
    lengths = torch.randint(32, 97, (2 * concurrency,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(kind: str, lengths: list[int], profile: cProfile.Profile | None = None) -> None:
        seconds, log = cell(make_engine(kind, target, drafter, concurrency), prompts, lengths, profile)
        print(f"{kind} {concurrency} {seconds:.2f}s rounds {len(log)} median {median_round_ms(log)} ms "
              f"width {statistics.fmean(entry['width'] for entry in log):.0f}", flush=True)

    for kind in ("nospec", "ha_plain"):  # warm-up
        run(kind, lengths[:8])
    for kind in ("nospec", "ha_plain") * 2:
        run(kind, lengths)
    for kind in ("nospec", "ha_plain"):
        profile = cProfile.Profile()
        run(kind, lengths, profile)
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
