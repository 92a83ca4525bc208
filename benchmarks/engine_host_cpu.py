"""Host time per round of `DSparkEngine(static=True)` with its graph rounds stubbed: what the engine's Python costs
(reading the round back, per-row bookkeeping, delivering tokens to the requests' streams, the round log), apart from
the device. CPU only; the numbers are this machine's.

    PYTHONPATH=src python benchmarks/engine_host_cpu.py --rows 256 --processes 3

Each process builds a tiny float32 engine of `--rows` rows (fixed γ = 7), admits one request per row, then replaces
the greedy round graphs by a copy of prerecorded rounds (accepted drafts ~ Geometric(0.5), τ about 2) and times
`engine.step()`: the best of `--repeats` batches of `--rounds` rounds, no admission among them. The result is the best
over `--processes` fresh processes (a shared machine's speed varies from process to process).

    PYTHONPATH=src python benchmarks/engine_host_cpu.py --chooser

times the hardware-aware `RoundWidthChooser` alone instead: µs per round of `choose` + `record` at 1, 16 and 256 rows
(widths 0, 1, 3, 7; width 7 the fastest; accepted drafts ~ Exponential(0.5), capped), the best of 5 × 20000 rounds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
import time

import torch

from serving import tiny_models

from dspark_hf.scheduling import RoundWidthChooser
from dspark_hf.serving import DSparkEngine


def host_ms_per_round(rows: int, rounds: int, repeats: int, on_engine=None) -> float:
    """The best ms per round; `on_engine` (tests) receives the engine afterwards."""
    target, drafter, _ = tiny_models()
    engine = DSparkEngine(target, drafter, max_batch_size=rows, max_model_len=64 + 8 * rounds * (repeats + 1),
                          static=True, policy="fixed", default_sampling={"temperature": 0})
    engine.warm_up(progress=False)
    generator = torch.Generator().manual_seed(0)
    record = engine.runner.rounds.record
    recorded = []
    for _ in range(16):
        fake = torch.randint(4, 96, record.shape, generator=generator)
        geometric = torch.distributions.Geometric(0.5).sample((record.shape[0],)).clamp(max=record.shape[1] - 2)
        fake[:, 0] = geometric.long()
        recorded.append(fake)
    count = itertools.count()

    def stub(verify: int):
        return lambda: record.copy_(recorded[next(count) % len(recorded)])

    engine.runner.rounds.greedy_round = stub
    for view in engine.runner.rounds._prefixes.values():
        view.greedy_round = stub
    for index in range(rows):
        engine.add_request([4 + index % 90] * 12, max_tokens=8 * rounds * (repeats + 1))
    engine.step()  # admits every request
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(rounds):
            engine.step()
        best = min(best, (time.perf_counter() - started) / rounds)
    if on_engine is not None:
        on_engine(engine)
    return 1e3 * best


def chooser_us_per_round(rows: int, rounds: int = 20000, repeats: int = 5) -> float:
    """The best µs per round of a fresh `RoundWidthChooser`'s `choose` + `record` over `repeats` runs."""
    rng = random.Random(0)
    accepted = [[min(7, int(rng.expovariate(0.5))) for _ in range(rows)] for _ in range(64)]
    best = float("inf")
    for _ in range(repeats):
        chooser = RoundWidthChooser((0, 1, 3, 7))
        started = time.perf_counter()
        for index in range(rounds):
            width = chooser.choose(rows)
            chooser.record(width, 0.001 if width == 7 else 0.0011, accepted[index % 64] if width else [], rows)
        best = min(best, (time.perf_counter() - started) / rounds)
    return 1e6 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--processes", type=int, default=3, help="0: this process only")
    parser.add_argument("--chooser", action="store_true", help="time RoundWidthChooser alone (see above)")
    args = parser.parse_args()
    if args.chooser:
        for rows in (1, 16, 256):
            print(f"RoundWidthChooser, rows {rows}: {chooser_us_per_round(rows):.1f} us per round")
        return
    if args.processes == 0:
        print(json.dumps(host_ms_per_round(args.rows, args.rounds, args.repeats)))
        return
    command = [sys.executable, __file__, "--rows", str(args.rows), "--rounds", str(args.rounds), "--repeats",
               str(args.repeats), "--processes", "0"]
    runs = [float(subprocess.check_output(command, text=True).strip().splitlines()[-1])
            for _ in range(args.processes)]
    print(f"rows {args.rows}: {min(runs):.3f} ms per round (processes: {' '.join(f'{r:.3f}' for r in runs)})")


if __name__ == "__main__":
    main()
