"""Replays measured static-engine rounds through `RoundWidthChooser`: how much its choices cost against the best fixed
width, on the round times the GPU actually gave, drift and stalls included. CPU only, seconds.

    PYTHONPATH=src python benchmarks/chooser_replay.py benchmarks/results/serving_static_round_logs_h200.json.gz \
        --out benchmarks/results/chooser_replay_h200.json

The input is a `benchmarks/serving.py --static --round-logs` file (either model) of runs with the policies no_spec,
fixed_3 and fixed_7 (fixed_1 too if it ran), stepped in turn. For each concurrency and run (the warm-up run first,
untimed as in the benchmark; one chooser lives across them), the replayed round i of a run of N rounds happens at
the fraction i / N of that run; a round verifying v drafts then takes the draft + verify time (`step_ms`) of the
fixed-v engine's round that ended nearest that moment (width 1 without a fixed_1 run: fixed_3's, whose measured cost
it nearly has; a stall, a round over 5 times its engine's median, counts as the median). Each row's accepted drafts
are drawn from hazards fitted to the hardware-aware engine's measured acceptance (its tokens per row at widths 1, 3
and 7), with one seed shared by every policy. Reported per concurrency: replayed tokens per second of draft + verify
time in the timed runs for the chooser and each fixed width, and the chooser's rounds per width. Admission and the
rest of a round are left out, though with admission_batch 1 the number of joins does depend on the widths: rounds
that commit more tokens finish more requests each, so fewer joins carry more rows (the 4B shape at c = 128, 2026-12-04:
fixed γ = 3 ahead of plain rounds by 5 % through admission alone; docs/serving_measurements.md).
"""

from __future__ import annotations

import argparse
import bisect
import functools
import gzip
import json
import random
import statistics
from pathlib import Path

from dspark_hf.scheduling import RoundWidthChooser

WIDTHS = (0, 1, 3, 7)
SOURCE = {0: "no_spec", 1: "fixed_1", 3: "fixed_3", 7: "fixed_7"}
STALL = 5  # a round more than this many times its engine's median is a stall, replayed as the median


def fitted_hazards(tokens_per_row: dict[int, float]) -> list[float]:
    """Hazards h_1..h_7 with 1 + S_1 = E(1), 1 + S_1 + S_2 + S_3 = E(3), 1 + S_1 + ... + S_7 = E(7): h_1, then one
    constant hazard for drafts 2-3 and one for 4-7 (bisection)."""
    def constant(survived: float, extra: float, count: int) -> float:
        low, high = 0.0, 1.0
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if survived * sum(middle ** k for k in range(1, count + 1)) < extra \
                else (low, middle)
        return low

    first = tokens_per_row[1] - 1
    middle = constant(first, tokens_per_row[3] - tokens_per_row[1], 2)
    last = constant(first * middle ** 2, tokens_per_row[7] - tokens_per_row[3], 4)
    return [first, middle, middle, last, last, last, last]


class MeasuredMachine:
    """Round times by width along one run, from the fixed engines' round logs of that run: draft + verify, or with
    `delivered` until the round's tokens were delivered (what the chooser has timed since bf4e130)."""

    def __init__(self, runs: dict[str, list[list]], delivered: bool = False):
        self.series, self.outside = {}, {}
        for width, name in SOURCE.items():
            log = runs.get(name) or (runs["fixed_3"] if width == 1 else None)
            ended = [entry[0] for entry in log]
            seconds = [(entry[6] + (entry[8] if delivered else 0.0)) / 1e3 for entry in log]
            typical = statistics.median(seconds)  # (a stall of about a second hit one engine or another once a call:
            seconds = [typical if value > STALL * typical else value for value in seconds]  # not the width's doing)
            self.series[width] = (ended, seconds)
            # the engine's step around the round (logs since 2026-12-06; 0 before), its stalls left as they are
            self.outside[width] = [(entry[11] if len(entry) > 11 and entry[11] is not None else 0.0) / 1e3
                                   for entry in log]
        self.duration = max(series[0][-1] for series in self.series.values())

    def _index(self, width: int, fraction: float) -> int:
        ended = self.series[width][0]
        at = fraction * self.duration
        index = min(bisect.bisect_left(ended, at), len(ended) - 1)
        if index > 0 and at - ended[index - 1] < ended[index] - at:
            index -= 1
        return index

    def seconds(self, width: int, fraction: float) -> float:
        return self.series[width][1][self._index(width, fraction)]

    def overhead(self, width: int, fraction: float) -> float:
        """The engine's step around that round (before it and after its delivery)."""
        return self.outside[width][self._index(width, fraction)]


def run_machines(runs: dict[str, list[list[list]]], delivered: bool = False) -> list[MeasuredMachine]:
    """One `MeasuredMachine` per run of a concurrency's round logs (`runs`: policy -> list of runs), in order."""
    return [MeasuredMachine({name: log[index] for name, log in runs.items()}, delivered)
            for index in range(len(runs["fixed_7"]))]


def replay(machines: list[MeasuredMachine], rounds: list[int], rows: int, hazards: list[float], width_policy,
           seed: int, record=None) -> tuple[float, dict[int, int]]:
    """Tokens per second of draft + verify time over `machines` (one per run; the first, the warm-up run, untimed)
    with `width_policy(rows)` choosing each round's width; `record(width, seconds, accepted, rows)` is told of every
    round during the next one, after that round's choice, and the last round of a run when the run ends (as
    `StaticRows.step` does). Also returns the rounds of each width in the timed runs."""
    rng = random.Random(seed)
    tokens, seconds, used = 0, 0.0, dict.fromkeys(WIDTHS, 0)
    for run, (machine, count) in enumerate(zip(machines, rounds)):
        unrecorded = None
        for index in range(count):
            width = width_policy(rows)
            if record is not None and unrecorded is not None:
                record(*unrecorded)
            took = machine.seconds(width, index / count)
            accepted = []
            for _ in range(rows):
                drafts = 0
                while drafts < width and rng.random() < hazards[drafts]:
                    drafts += 1
                accepted.append(drafts)
            unrecorded = (width, took, accepted, rows)
            if run == 0:
                continue
            tokens += rows + sum(accepted)
            seconds += took
            used[width] += 1
        if record is not None and unrecorded is not None:
            record(*unrecorded)
    return tokens / seconds, used


def replay_concurrency(runs: dict[str, list[list[list]]], tokens_per_row: dict[int, float], rows: int,
                       seed: int = 0, captured: bool = False, **chooser_options) -> dict:
    """Every policy replayed on the runs of one concurrency (`runs`: policy -> list of runs). `captured`: the
    engine captured every graph at warm-up (library 0b0769a on), so the chooser times each width's first rounds;
    `chooser_options` go to `RoundWidthChooser` (its draws seeded with `seed`)."""
    machines = run_machines(runs)
    count = len(machines)
    rounds = [len(run) for run in runs["hardware_aware"]]
    hazards = fitted_hazards(tokens_per_row)
    fixed = {width: replay(machines, rounds, rows, hazards, lambda _, width=width: width, seed)[0]
             for width in WIDTHS}
    chooser = RoundWidthChooser(WIDTHS, seed=seed, **chooser_options)
    record = functools.partial(chooser.record, captured=captured)
    rate, used = replay(machines, rounds, rows, hazards, chooser.choose, seed, record)
    best = max(fixed, key=fixed.get)
    return dict(rows=rows, runs=count, hazards=[round(h, 4) for h in hazards],
                tokens_per_second={"hardware_aware": rate} | {f"fixed_{width}": fixed[width] for width in WIDTHS},
                chooser_over_best_fixed=rate / fixed[best], best_fixed=best,
                chooser_rounds={str(width): used[width] for width in WIDTHS})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("round_logs", type=Path)
    parser.add_argument("--results", type=Path, help="the benchmark's JSON of the same call: the hardware-aware "
                        "engine's measured tokens per row (default: the round logs' path without .gz)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--captured", action="store_true", help="the engine captured every graph at warm-up")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logs = json.load(gzip.open(args.round_logs, "rt"))
    results = json.loads((args.results or args.round_logs.with_suffix("")).read_text())
    (model,) = results["models"].values()  # (one model per benchmark file)
    cells = {str(cell["concurrency"]): cell for cell in model["results"]["hardware_aware"]}
    report = {}
    for concurrency, runs in logs["runs"].items():
        measured = cells[concurrency]["chooser"][concurrency]
        tokens_per_row = {int(width): entry["tokens_per_row"] for width, entry in measured.items()}
        seeds = [replay_concurrency(runs, tokens_per_row, int(concurrency), seed, args.captured)
                 for seed in range(args.seeds)]
        ratios = [entry["chooser_over_best_fixed"] for entry in seeds]
        report[concurrency] = dict(seeds[0], chooser_over_best_fixed_by_seed=ratios,
                                   chooser_over_best_fixed_median=statistics.median(ratios))
        print(f"c={concurrency:>4}: chooser / best fixed (fixed_{seeds[0]['best_fixed']}) "
              f"{' '.join(f'{r:.3f}' for r in ratios)}; rounds by width {seeds[0]['chooser_rounds']}")
    if args.out:
        args.out.write_text(json.dumps(dict(source=str(args.round_logs), captured=args.captured,
                                            concurrency=report), indent=2)
                            + "\n")


if __name__ == "__main__":
    main()
