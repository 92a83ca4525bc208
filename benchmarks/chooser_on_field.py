"""The static engine's round widths served on a measured acceptance field: any policy, any concurrency, in seconds.

    PYTHONPATH=src:benchmarks python benchmarks/chooser_on_field.py \
        benchmarks/results/acceptance_field_code50m_cpu.json --concurrency 1 --seeds 8 --out ...

`benchmarks/acceptance_field.py` gives, for each of the serving cells' code50m requests, the drafts a round anchored at
each of its positions accepts (greedy decoding commits the same tokens under every policy, so a round's acceptance
depends only on where it starts and how many drafts it verifies). This serves `benchmarks/chooser_on_text.py`'s
requests on that field the way `DSparkEngine(static=True)` runs them there (`--concurrency` rows every round, joins at
once into the lowest free row, a warm-up run of 8-token requests, then `--repeats` timed runs, one chooser across
them), with each round taking its width's GPU time (`--times`, milliseconds of plain, γ = 1, 3 and 7 rounds) times
log-normal noise, or with `--round-logs` (a `serving.py --static --round-logs` file of the same cell) the time the GPU
gave that width's fixed engine at that point of the same run, its drift and noise included; `--switch-cost` adds what a
round pays after a round of another width. The chooser is called as the engine calls it: each round's width chosen
while the round before runs (before that round is recorded), `refine`d once the round before is done, `prepare`d during
the round. So it replays what `chooser_on_text.py` measures (its fixed widths exactly, the chooser to within the
drafter context a long plain run drops) about a thousand times faster, which makes seeds cheap: each policy's tokens
per second is reported per seed (the noise's and the chooser's draws), and hardware-aware's ratio to the best fixed
width as mean ± standard error over the seeds. `--admission-ms` charges each request's admission (with its prompt's
drafter context, or without it for plain decoding and for the chooser after a long run of plain rounds) and tells the
chooser of it, as `StaticRows` does (`--untold-admissions`: charged but not told); the acceptance of rows that joined
without the context is taken as that of the others (in the engine their drafts see less context until it fills).
`--catch-up-ms` charges the catch-up a drafting round runs first after bare plain rounds or such admissions, and tells
the chooser the round's time without it, as `StaticRows` does since 2026-12-07 (`--told-catch-up`: with it, as before).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from chooser_on_text import add_cell_arguments
from chooser_replay import MeasuredMachine, run_machines
from common import environment
from serving import request_count, request_lengths

from dspark_hf.generation.static_rows import PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER, plain_run_after
from dspark_hf.scheduling.round_widths import AFTER_PLAIN, FULL, RoundWidthChooser

WIDTHS = (0, 1, 3, 7)


class FieldRows:
    """A static engine's rows on the acceptance field: which request each row serves and where it stands."""

    def __init__(self, field: list[list[int]], concurrency: int):
        self.field, self.concurrency = field, concurrency
        self.requests: list[tuple[int, int] | None] = [None] * concurrency  # (field row, tokens left to commit)
        self.position = [0] * concurrency  # each row's anchor: its request's new tokens committed, less one
        self.states = [AFTER_PLAIN] * concurrency  # each row's `acceptance_state` after its last round
        self.lengths = [0] * concurrency  # each row's request's tokens
        self.finished: list[int] = []  # the tokens of the requests that left in the last round
        self.plain_run = 0  # plain rounds in a row, across runs (`StaticRows.plain_rounds_in_a_row`)

    def admit(self, waiting: list[tuple[int, int]]) -> int:
        """Joins waiting (field row, length) requests into the free rows, lowest first; the prefill commits a
        request's first token. Returns how many joined."""
        joined = 0
        for slot in range(self.concurrency):
            if self.requests[slot] is None and waiting:
                field_row, length = waiting.pop(0)
                self.requests[slot], self.position[slot], self.states[slot] = (field_row, length - 1), 0, AFTER_PLAIN
                self.lengths[slot] = length
                joined += 1
        return joined

    def occupied(self) -> list[int]:
        return [slot for slot, request in enumerate(self.requests) if request is not None]

    def round(self, width: int) -> list[int]:
        """One round verifying `width` drafts of every row: each occupied row's accepted drafts (as the engine
        records them: not cut at the request's end); finished requests leave."""
        accepted_drafts, self.finished = [], []
        for slot in self.occupied():
            field_row, left = self.requests[slot]
            accepted = min(self.field[field_row][self.position[slot]], width)
            committed = min(accepted + 1, left)
            self.position[slot] += committed
            self.requests[slot] = (field_row, left - committed) if left > committed else None
            if left <= committed:
                self.finished.append(self.lengths[slot])
            accepted_drafts.append(accepted)
        return accepted_drafts


def serve(field: list[list[int]], lengths: list[int], rows: FieldRows, width: int | None,
          chooser: RoundWidthChooser | None, round_seconds: Callable[[int, float], float],
          switch_cost: float = 0.0, step_overhead: Callable[[int, float], float] | None = None,
          overhead: str = "told", admission: tuple[float, float] | None = None, told_admissions: bool = True,
          catch_up: float = 0.0, told_catch_up: bool = False) -> dict:
    """One run of requests of `lengths` (request i on field row i mod the field's rows): tokens, GPU seconds and
    rounds per width; a fixed `width`, or `chooser`'s choice each round, which takes `round_seconds(width, seconds
    of the run so far)`, times 1 + `switch_cost` after a round of another width, and `step_overhead(width, seconds
    of the run so far)` more for the server's step around it, which the chooser is told (`overhead`): as
    `RoundWidthChooser.record`'s overhead ("told", as the engine does), in the round's seconds ("folded") or not
    ("none"). `admission`: a request's admission seconds with its prompt's drafter context and without it (None:
    free), the latter for plain decoding (`width` 0) and for the chooser's requests that join after
    `PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER` plain rounds in a row (its probes neither end nor lengthen the run), as
    `StaticRows` admits them; the chooser is told each admission and each request that leaves (unless not
    `told_admissions`: as before 2026-12-06). `catch_up`: the seconds a drafting round pays first after bare plain
    rounds (`PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER` plain rounds in a row on) or admissions without the prompts'
    drafter context, as `StaticRows` runs `StaticBatchRounds.catch_up`; the chooser gets the round's time without it
    (with `told_catch_up`, with it: as before 2026-12-07)."""
    told_admissions = told_admissions and chooser is not None
    waiting = [(index % len(field), length) for index, length in enumerate(lengths)]
    seconds, widths, planned, unrecorded, drafted_last, last_width = 0.0, Counter(), None, None, False, None
    reason = round_reason = None  # (the chooser's reason for the planned width; for this round's)
    states_current, behind = True, False  # (behind: the next drafting round catches up first)
    count = rows.concurrency
    while waiting or rows.occupied():
        joined = rows.admit(waiting)
        context = width != 0 and rows.plain_run < PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER
        behind = behind or (joined > 0 and not context)
        if joined and admission is not None:
            admitting = joined * admission[0 if context else 1]
            seconds += admitting
            if told_admissions:
                chooser.record_admission(admitting, joined, context)
        occupied = rows.occupied()
        states = None
        if chooser is not None:
            if planned is None:
                planned, reason = chooser.choose(count), chooser.reason
            verify = planned
            tracked = len(occupied) <= chooser.state_rows
            if tracked and not drafted_last:
                states = [AFTER_PLAIN] * len(occupied)
            elif tracked and states_current:
                states = [rows.states[slot] for slot in occupied]
            chosen, refined, round_reason = verify, False, reason
            if states is not None:
                verify = chooser.refine(verify, states, count)
                refined = verify != chosen
                round_reason = chooser.reason if refined else reason
        else:
            verify = width
        took = round_seconds(verify, seconds) * (1.0 + switch_cost if last_width not in (None, verify) else 1.0)
        caught_up = 0.0  # (the catch-up's seconds this round ran first)
        if verify == 0 and rows.plain_run >= PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER:  # a bare plain round
            behind = True
        elif verify > 0 and behind:
            caught_up, behind = catch_up, False
        took += caught_up
        around = step_overhead(verify, seconds) if step_overhead is not None else 0.0
        last_width = verify
        if chooser is not None:  # during the round: the one before recorded, the next one's width chosen
            if unrecorded is not None:
                chooser.record(*unrecorded[:-2], overhead=unrecorded[-2], refined=unrecorded[-1])
            planned, reason = chooser.choose(count), chooser.reason
            if len(occupied) <= chooser.state_rows:
                chooser.prepare(count)
        accepted = rows.round(verify)
        if told_admissions and rows.finished:
            chooser.record_finished(sum(rows.finished), len(rows.finished))
        seconds += took + around
        widths[verify] += 1
        drafted_last = verify > 0
        rows.plain_run = plain_run_after(rows.plain_run, verify, round_reason)
        if chooser is not None:
            timed = took if told_catch_up else took - caught_up
            told = {"told": (timed, around), "folded": (timed + around, None), "none": (timed, None)}[overhead]
            unrecorded = (verify, told[0], accepted, count, False, states, told[1], refined)
            states_current = len(occupied) <= chooser.state_rows and verify > 0
            if states_current:
                for slot, drafts in zip(occupied, accepted):
                    rows.states[slot] = drafts if drafts < verify else FULL + verify
            if not rows.occupied():
                chooser.record(*unrecorded[:-2], overhead=unrecorded[-2], refined=unrecorded[-1])
                planned, unrecorded = None, None
    tokens = sum(lengths)
    return dict(tokens=tokens, gpu_seconds=seconds, tokens_per_second=tokens / seconds,
                rounds=dict(sorted(widths.items())))


def noisy_times(times: dict[int, float], spread: float, rng: random.Random) -> Callable[[int, float], float]:
    """Each round its width's time × log-normal noise of `spread`."""
    return lambda width, _: times[width] * math.exp(rng.gauss(0.0, spread))


def measured_times(machine: MeasuredMachine, part: str = "seconds") -> Callable[[int, float], float]:
    """Each round the time the GPU gave its width's fixed engine at that point of the same run (a run served here
    running longer than the GPU's takes the times of its end): the round's seconds, or with `part="overhead"` the
    engine's step around it."""
    return lambda width, elapsed: getattr(machine, part)(width, min(elapsed / machine.duration, 1.0))


def run_policy(field: list[list[int]], policy: str, concurrency: int, args, seed: int, chooser_options: dict,
               machines: list[MeasuredMachine] | None = None) -> list[dict]:
    """A warm-up run of 8-token requests, then `args.repeats` timed runs of one policy's engine; rounds timed by
    `noisy_times`, or with `machines` (the warm-up run's, then each timed run's) by `measured_times`."""
    rng = random.Random(seed)
    rows = FieldRows(field, concurrency)
    chooser = RoundWidthChooser(WIDTHS, seed=seed, **chooser_options) if policy == "hardware_aware" else None
    admission = None if args.admission_ms is None else (args.admission_ms[0] / 1e3, args.admission_ms[1] / 1e3)
    if chooser is not None and admission is not None:  # (as `StaticRows.warm_up` times the two admission graphs)
        chooser.admission_ratio = min(1.0, admission[1] / admission[0])
    width = None if chooser is not None else int(policy.removeprefix("fixed_"))
    times = {width: ms / 1e3 for width, ms in zip(WIDTHS, args.times)}
    catch_up = args.catch_up_ms / 1e3
    clocks = [measured_times(machine) for machine in machines] if machines else \
        [noisy_times(times, args.spread, rng)] * (args.repeats + 1)
    around = [measured_times(machine, "overhead") for machine in machines] if machines else [None] * len(clocks)
    warm_up = argparse.Namespace(**{**vars(args), "max_new_tokens": 8})
    serve(field, request_lengths(request_count(concurrency, warm_up), warm_up), rows, width, chooser, clocks[0],
          args.switch_cost, around[0], args.overhead, admission, not args.untold_admissions, catch_up,
          args.told_catch_up)
    lengths = request_lengths(request_count(concurrency, args), args)
    return [serve(field, lengths, rows, width, chooser, clock, args.switch_cost, step_overhead, args.overhead,
                  admission, not args.untold_admissions, catch_up, args.told_catch_up)
            for clock, step_overhead in zip(clocks[1: args.repeats + 1], around[1:])]


def cell(field: list[list[int]], concurrency: int, args, chooser_options: dict,
         machines: list[MeasuredMachine] | None = None) -> dict:
    """Every policy over `args.seeds` seeds at one concurrency: each one's tokens per second per seed (timed runs
    pooled), and hardware-aware over the best fixed width (mean, standard error)."""
    per_seed = {policy: [] for policy in args.policies}
    rounds = {policy: Counter() for policy in args.policies}
    for seed in range(args.seeds):
        for policy in args.policies:
            runs = run_policy(field, policy, concurrency, args, seed, chooser_options, machines)
            per_seed[policy].append(sum(run["tokens"] for run in runs) / sum(run["gpu_seconds"] for run in runs))
            for run in runs:
                rounds[policy].update(run["rounds"])
    result = dict(tokens_per_second={policy: statistics.mean(rates) for policy, rates in per_seed.items()},
                  per_seed=per_seed, rounds={policy: dict(sorted(counts.items())) for policy, counts in rounds.items()})
    fixed = [policy for policy in args.policies if policy != "hardware_aware"]
    if "hardware_aware" in per_seed and fixed:
        best = max(fixed, key=result["tokens_per_second"].__getitem__)
        ratios = [ha / rate for ha, rate in zip(per_seed["hardware_aware"], per_seed[best])]
        result.update(best_fixed=best, hardware_aware_over_best_fixed=statistics.mean(ratios),
                      standard_error=statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("field", type=Path, help="benchmarks/acceptance_field.py's output")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    add_cell_arguments(parser)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--policies", nargs="+", default=["fixed_0", "fixed_1", "fixed_3", "fixed_7", "hardware_aware"])
    parser.add_argument("--chooser", nargs="*", default=[], metavar="NAME=VALUE",
                        help="RoundWidthChooser arguments for hardware-aware, e.g. state_rows=0")
    parser.add_argument("--switch-cost", type=float, default=0.0,
                        help="a round after a round of another width takes this fraction longer (on an H100 about "
                             "0.01-0.02: docs/serving_measurements.md)")
    parser.add_argument("--round-logs", type=Path,
                        help="a `serving.py --static --round-logs` file: each round takes the time the GPU gave its "
                             "width's fixed engine at that point of the same run (--times and --spread unused)")
    parser.add_argument("--overhead", choices=["told", "folded", "none"], default="told",
                        help="with --round-logs of 2026-12-06 on: the engine's step around each round (outside_ms) "
                             "costs every policy; hardware-aware is told it as RoundWidthChooser.record's overhead "
                             "(told, as the engine does), in the round's seconds (folded) or not at all (none)")
    parser.add_argument("--admission-ms", type=float, nargs=2, metavar=("CONTEXT", "PLAIN"),
                        help="a request's admission milliseconds with its prompt's drafter context and without it "
                             "(plain decoding; the chooser after a long run of plain rounds); default: free (on an "
                             "H100 at c = 128: 0.2225 and 0.2033)")
    parser.add_argument("--untold-admissions", action="store_true",
                        help="with --admission-ms: the admissions cost their time but the chooser is not told them")
    parser.add_argument("--catch-up-ms", type=float, default=0.0,
                        help="what a drafting round pays first after bare plain rounds (StaticBatchRounds.catch_up; "
                             "on an H100 at c = 64 about 0.8 ms); the chooser gets the round's time without it")
    parser.add_argument("--told-catch-up", action="store_true",
                        help="with --catch-up-ms: the chooser gets the round's time with it (before 2026-12-07)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    field = json.loads(args.field.read_text())["accepted"]
    chooser_options = {name: float(value) if "." in value else int(value)
                       for name, value in (setting.split("=") for setting in args.chooser)}
    report = dict(field=str(args.field), cells={}, environment=environment(), command=vars(args) | {
        "field": str(args.field), "out": str(args.out), "round_logs": str(args.round_logs)})
    logs = json.loads(gzip.decompress(args.round_logs.read_bytes()))["runs"] if args.round_logs else None
    for concurrency in args.concurrency:
        machines = None
        if logs is not None:
            machines = run_machines(logs[str(concurrency)], delivered=True)
            if len(machines) < args.repeats + 1:
                raise SystemExit(f"{args.round_logs} holds {len(machines)} runs at c = {concurrency}: "
                                 f"--repeats {args.repeats} needs {args.repeats + 1}")
        result = report["cells"][concurrency] = cell(field, concurrency, args, chooser_options, machines)
        print(f"c = {concurrency}: " + json.dumps({key: value for key, value in result.items() if key != "per_seed"}),
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
