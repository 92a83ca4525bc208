"""Replays a static-engine cell's plain decoding under other admission settings: how the time spent joining and
decoding changes with `DSparkEngine(admission_batch=...)`, from the join and round times the GPU gave. CPU only.

    PYTHONPATH=src python benchmarks/admission_replay.py \
        benchmarks/results/serving_static_4b_longer_runs_h200.json.gz \
        --out benchmarks/results/admission_replay_4b_longer_runs_h200.json

The input is a `benchmarks/serving.py --static --round-logs` file (its cells JSON next to it, or `--results`; a
concurrency merged in from another call reads that call's settings, `settings_c<c>`). Per concurrency, from the
no-speculation engine's timed runs: one admission set's time (the median over joins into a
running batch of the join's time over its sets of `admission_rows` rows), the first prefill's time and a round's
time (the median draft + verify, plus the cell's other host time per round). The cell's requests (the benchmark's
own lengths) then run through a model of the engine: a round commits one token per running request, a join costs
its sets and commits each joiner's first token, and the rows join by the engine's own gate for each
`admission_batch` (`serving.admission`). Reported: modelled tokens per second and joins per setting, and, for the
setting the cell ran, the model's time next to each run's measured admission, draft + verify and other host time.
Plain decoding only: with drafts, how many requests finish per round depends on acceptance.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import statistics
import sys
from pathlib import Path

from serving import request_count, request_lengths

from dspark_hf.serving.admission import FreeRowsGate, JoinGate

SETTINGS = (1, 4, 16, "auto")


def modelled_cell(lengths: list[int], concurrency: int, rows_per_set: int, set_seconds: float, first_seconds: float,
                  round_seconds: float, admission_batch: int | str) -> tuple[float, list[int]]:
    """The modelled cell: seconds from the first join to the last round, and the number of requests in each join."""
    rows_per_set = min(rows_per_set, concurrency)
    gate = JoinGate(rows_per_set) if admission_batch == "auto" else FreeRowsGate(admission_batch)
    waiting, running, seconds, joins = list(lengths), [], 0.0, []
    while waiting or running:
        free = concurrency - len(running)
        joining = gate.rows_to_join(free, len(waiting), len(running))
        admitted, waiting = waiting[:joining], waiting[joining:]
        admit_seconds = 0.0
        if admitted:
            admit_seconds = first_seconds if not running else math.ceil(len(admitted) / rows_per_set) * set_seconds
            joins.append(len(admitted))
            running = [left for left in running + [length - 1 for length in admitted] if left > 0]  # (first tokens)
        step_seconds = round_seconds if running else 0.0
        running = [left - 1 for left in running if left > 1]
        seconds += admit_seconds + step_seconds
        gate.record(len(admitted), admit_seconds, step_seconds)
    return seconds, joins


def measured_costs(runs: list[list[dict]], rows_per_set: int) -> dict[str, float]:
    """Seconds of one admission set, of the first prefill and of a round's draft + verify, from timed runs' logs."""
    sets, firsts, steps = [], [], []
    for rounds in runs:
        firsts.append(rounds[0]["admit_ms"] / 1e3)
        sets += [entry["admit_ms"] / 1e3 / math.ceil(entry["admitted"] / rows_per_set)
                 for entry in rounds[1:] if entry["admitted"]]
        steps += [entry["step_ms"] / 1e3 for entry in rounds]
    return dict(set_seconds=statistics.median(sets), first_seconds=statistics.median(firsts),
                step_seconds=statistics.median(steps))


def replay_cell(runs: list[list[dict]], cell: dict, settings: dict, admission_batch: int | str,
                rows_per_set: int) -> dict:
    concurrency = cell["concurrency"]
    rows_per_set = min(rows_per_set, concurrency)
    costs = measured_costs(runs, rows_per_set)
    other = cell["other_ms_per_round"] / 1e3  # the cell's host time per round outside the round's step
    round_seconds = costs["step_seconds"] + other
    args = argparse.Namespace(**settings)
    lengths = request_lengths(request_count(concurrency, args), args)
    modelled = {}
    for setting in dict.fromkeys((*SETTINGS, admission_batch)):
        batch = setting if setting == "auto" else min(setting, concurrency)
        seconds, joins = modelled_cell(lengths, concurrency, rows_per_set, costs["set_seconds"],
                                       costs["first_seconds"], round_seconds, batch)
        modelled[str(setting)] = dict(tokens_per_second=sum(lengths) / seconds, seconds=seconds, joins=len(joins))
    measured = [sum(entry["admit_ms"] + entry["step_ms"] for entry in rounds) / 1e3 + other * len(rounds)
                for rounds in runs]
    return dict(costs=costs, round_seconds=round_seconds, requests=len(lengths), modelled=modelled,
                ran=str(admission_batch), measured_seconds=measured,
                measured_joins=[sum(1 for entry in rounds if entry["admitted"]) for rounds in runs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("round_logs", type=Path)
    parser.add_argument("--results", type=Path, help="the benchmark's JSON of the same call (default: the round "
                                                     "logs' name without .gz)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logs = json.load(gzip.open(args.round_logs, "rt"))
    results = json.loads((args.results or args.round_logs.with_suffix("")).read_text())
    (model, entry), = results["models"].items()
    columns = logs["columns"]
    report = dict(benchmark="admission_replay", command="python " + " ".join(sys.argv), model=model,
                  source=str(args.round_logs), cells={})
    for concurrency, policies in sorted(logs["runs"].items(), key=lambda item: int(item[0])):
        if not any(row[columns.index("admitted")] for run in policies["no_spec"][1:] for row in run[1:]):
            print(f"c={int(concurrency):4d}: no join into a running batch to time (every request joined at once)")
            continue
        settings = entry.get(f"settings_c{concurrency}", entry["settings"])  # (calls merged by concurrency)
        engine = re.search(r"admission_batch (\w+), admission_rows (\d+)", settings["engine"])
        ran = engine.group(1) if engine.group(1) == "auto" else int(engine.group(1))
        rows_per_set = int(engine.group(2))
        runs = [[dict(zip(columns, row)) for row in run] for run in policies["no_spec"][1:]]  # (timed runs)
        cell = next(c for c in entry["results"]["no_spec"] if c["concurrency"] == int(concurrency))
        report["cells"][concurrency] = replayed = replay_cell(runs, cell, settings, ran, rows_per_set)
        rates = ", ".join(f"{name} {value['tokens_per_second']:.0f} ({value['joins']} joins)"
                          for name, value in replayed["modelled"].items())
        measured = ", ".join(f"{seconds:.2f}" for seconds in replayed["measured_seconds"])
        print(f"c={int(concurrency):4d}: modelled tok/s by admission_batch: {rates}; ran {ran}: modelled "
              f"{replayed['modelled'][str(ran)]['seconds']:.2f} s, measured {measured} s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
