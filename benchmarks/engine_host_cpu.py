"""Host time per round of `DSparkEngine(static=True)` with its graph rounds stubbed: what the engine's Python costs
(reading the round back, per-row bookkeeping, delivering tokens to the requests' streams, the round log), apart from
the device. CPU only; the numbers are this machine's.

    PYTHONPATH=src python benchmarks/engine_host_cpu.py --rows 256 --processes 3

Each process builds a tiny float32 engine of `--rows` rows (fixed γ = 7), admits one request per row, then replaces
the greedy round graphs by a copy of prerecorded rounds (accepted drafts ~ Geometric(0.5), τ about 2) and times
`engine.step()`: the best of `--repeats` batches of `--rounds` rounds, no admission among them. The result is the best
over `--processes` fresh processes (a shared machine's speed varies from process to process).

    PYTHONPATH=src python benchmarks/engine_host_cpu.py --chooser

times the hardware-aware `RoundWidthChooser` alone instead: µs per round of `record` + `choose` (+ `prepare` in rounds
of at most `state_rows` rows; the engine runs them while the device runs a round) and of `refine` with the rows'
states (in such rounds; between a round's end and the next one's launch), at 1, 4, 16 and 256 rows (widths 0, 1, 3,
7; width 7 the fastest; accepted drafts ~ Exponential(0.5), capped), the best of 5 × 20000 rounds.

    PYTHONPATH=src python benchmarks/engine_host_cpu.py --contexts

times what the static engine entered around every round until it stopped doing so (replays need neither): the kernel
choices (`static_loop.kernels_active` with the static-cache attention and fused projections, as on CUDA: each model's
attention implementation set and restored) for the target alone and for target and drafter, and the drafter's tap
(`TargetLayerTap`: hooks registered and removed); µs per enter + exit, the best of 5 × 20000.

    PYTHONPATH=src python benchmarks/engine_host_cpu.py --gc --rows 256

measures the garbage collector instead (`collector_pauses`): four stubbed engines serve four runs of 4 × `--rows`
requests each in turn, as the serving benchmark's static cells do, and the pauses within them come back with the
time of one full collection afterwards.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import subprocess
import sys
import time

import torch

from serving import tiny_models

from dspark_hf.scheduling import RoundWidthChooser
from dspark_hf.scheduling.round_widths import AFTER_PLAIN, acceptance_state
from dspark_hf.serving import DSparkEngine


def stubbed_engine(target, drafter, rows: int, max_model_len: int) -> DSparkEngine:
    """A warmed-up static engine (fixed γ = 7) whose greedy rounds copy prerecorded rounds into the record instead
    of running the models (admission still prefills for real)."""
    engine = DSparkEngine(target, drafter, max_batch_size=rows, max_model_len=max_model_len, static=True,
                          policy="fixed", default_sampling={"temperature": 0})
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

    def stub(verify: int, bare: bool = False):
        return lambda: record.copy_(recorded[next(count) % len(recorded)])

    engine.runner.rounds.greedy_round = stub
    for view in engine.runner.rounds._prefixes.values():
        view.greedy_round = stub
    return engine


def host_ms_per_round(rows: int, rounds: int, repeats: int, on_engine=None) -> float:
    """The best ms per round; `on_engine` (tests) receives the engine afterwards."""
    target, drafter, _ = tiny_models()
    engine = stubbed_engine(target, drafter, rows, 64 + 8 * rounds * (repeats + 1))
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


def collector_pauses(rows: int, engines: int = 4, runs: int = 4, prompt_tokens: int = 150, new_tokens: int = 64
                     ) -> dict:
    """The garbage collector's pauses while `engines` stubbed engines of `rows` rows serve `runs` runs in turn, as
    benchmarks/serving.py's static cells do: each run queues 4 × `rows` requests per engine (prompts of
    `prompt_tokens`, `new_tokens` each) and keeps their handles until the next run queues its own. Returns the pauses
    (ms and count by generation), the rounds, then the objects the collector still tracks apart from the frozen
    start-up heap and the time of one full collection over them."""
    target, drafter, _ = tiny_models()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (prompt_tokens,), generator=generator).tolist() for _ in range(16)]
    served = [stubbed_engine(target, drafter, rows, prompt_tokens + new_tokens + 16) for _ in range(engines)]
    pauses: dict[int, list[float]] = {}
    started = [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        entry = pauses.setdefault(info["generation"], [0, 0.0])
        entry[0] += 1
        entry[1] += 1e3 * (time.perf_counter() - started[0])

    gc.callbacks.append(on_collection)
    rounds = 0
    try:
        for _ in range(runs):
            handles = [[engine.add_request(prompts[index % len(prompts)], max_tokens=new_tokens, ignore_eos=True)
                        for index in range(4 * rows)] for engine in served]
            while any(engine.has_unfinished() for engine in served):
                for engine in served:
                    rounds += engine.step()
    finally:
        gc.callbacks.remove(on_collection)
    assert all(len(handle.tokens) == new_tokens for run in handles for handle in run)
    tracked = len(gc.get_objects())
    collection = time.perf_counter()
    gc.collect()
    return dict(rows=rows, engines=engines, runs=runs, rounds=rounds,
                pauses={f"gen{generation}": dict(count=count, ms=round(ms, 2))
                        for generation, (count, ms) in sorted(pauses.items())},
                pause_ms=round(sum(ms for _, ms in pauses.values()), 2), tracked_after=tracked,
                full_collection_ms=round(1e3 * (time.perf_counter() - collection), 2))


def chooser_us_per_round(rows: int, rounds: int = 20000, repeats: int = 5) -> tuple[float, float]:
    """The best µs per round of a fresh `RoundWidthChooser` over `repeats` runs, called as the static engine calls it:
    its work while the device runs a round (`record`, `choose`, and in rounds of at most `state_rows` rows `prepare`),
    and between a round's end and the next one's launch (in such rounds: `refine` with the rows' states)."""
    rng = random.Random(0)
    accepted = [[min(7, int(rng.expovariate(0.5))) for _ in range(rows)] for _ in range(64)]
    best_during = best_between = float("inf")
    for _ in range(repeats):
        chooser = RoundWidthChooser((0, 1, 3, 7))
        tracked = rows <= chooser.state_rows
        during = between = 0.0
        states, planned = [AFTER_PLAIN] * rows, chooser.choose(rows)
        for index in range(rounds):
            started = time.perf_counter()
            width = chooser.refine(planned, states, rows) if tracked else planned
            middle = time.perf_counter()
            row_accepted = accepted[index % 64] if width else []
            chooser.record(width, 0.001 if width == 7 else 0.0011, row_accepted, rows,
                           states=states if tracked and width else None)
            planned = chooser.choose(rows)
            if tracked:
                chooser.prepare(rows)
            ended = time.perf_counter()
            states = [acceptance_state(width, count) for count in row_accepted] or [AFTER_PLAIN] * rows
            during, between = during + ended - middle, between + middle - started
        best_during, best_between = min(best_during, during / rounds), min(best_between, between / rounds)
    return 1e6 * best_during, 1e6 * best_between
def context_us(context, calls: int = 20000, repeats: int = 5) -> float:
    """The best µs per `with context():` (enter + exit, empty body) over `repeats` runs of `calls`."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            with context():
                pass
        best = min(best, (time.perf_counter() - started) / calls)
    return 1e6 * best


def round_contexts_us() -> dict[str, float]:
    """µs per enter + exit of the contexts the static engine entered around every round (see the module docstring)."""
    from dspark_hf.generation.static_loop import kernels_active
    from dspark_hf.models import TargetLayerTap

    target, drafter, _ = tiny_models()
    tap = TargetLayerTap(target, drafter.config.target_layer_ids)
    return {"kernels_target": context_us(lambda: kernels_active(target, None, True, True)),
            "kernels_target_and_drafter": context_us(lambda: kernels_active(target, drafter, True, True)),
            "tap": context_us(lambda: tap)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--processes", type=int, default=3, help="0: this process only")
    parser.add_argument("--chooser", action="store_true", help="time RoundWidthChooser alone (see above)")
    parser.add_argument("--gc", action="store_true", help="the garbage collector's pauses while serving (see above)")
    parser.add_argument("--contexts", action="store_true", help="the contexts once entered around every round")
    args = parser.parse_args()
    if args.contexts:
        print(json.dumps({name: round(us, 1) for name, us in round_contexts_us().items()}))
        return
    if args.gc:
        print(json.dumps(collector_pauses(args.rows)))
        return
    if args.chooser:
        for rows in (1, 4, 16, 256):
            during, between = chooser_us_per_round(rows)
            print(f"RoundWidthChooser, rows {rows}: {during:.1f} us per round while it runs, {between:.1f} us between "
                  "rounds")
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
