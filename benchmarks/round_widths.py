"""The static engine's round time per number of verified drafts v, on the 50M code fixture and its trained drafter.

    PYTHONPATH=src:benchmarks python benchmarks/round_widths.py --rows 64 --out benchmarks/results/round_widths_cpu.json
    PYTHONPATH=src:benchmarks python benchmarks/round_widths.py --device cuda --dtype bfloat16 --compile --rows 64 256

`DSparkEngine(static=True)` runs rounds of `StaticBatchRounds` that verify v of each row's γ = 7 drafts (v = 0: a
plain round); the hardware-aware chooser picks v per round from their measured times. For each number of rows this
builds the engine's rows (`StaticRows`: its kernels, caches and pending drafter context), prefills that many HumanEval
prompts (their first `--prompt-tokens` tokens), then times greedy rounds of v = 0, 1, 3 and 7 in turn (`--repeats`
sweeps of `--rounds` rounds each, after one untimed sweep), each round after an untimed `flush()` of the drafter's
pending context (which plain rounds fill). Reported per v: the median ms per round and its ratio to the plain round's.
On CUDA each round is timed to its end (synchronised); `--compile` replays each width's captured graph, as the engine
does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import environment
from round_speed import left_pad
from serving import load_models

from dspark_hf.generation.static_rows import StaticRows

WIDTHS = (0, 1, 3, 7)


def round_ms(target, drafter, prompts: list[list[int]], rows: int, args) -> dict:
    """Median ms per greedy round of each width at `rows` rows."""
    chosen = [prompts[index % len(prompts)][: args.prompt_tokens] for index in range(rows)]
    ids, mask = left_pad(chosen, 0, "cpu")  # (prefill moves them to the models' device)
    sweeps = args.repeats + 1
    columns = sweeps * args.rounds * sum(width + 1 for width in WIDTHS)
    runner = StaticRows(target, drafter, rows, max_model_len=ids.shape[1] + columns, compile=args.compile)
    rounds = runner.rounds  # (with the engine's kernels: on CUDA the static-cache attention and fused projections)
    rounds.prefill(ids, mask)
    device = torch.device(args.device)
    times = {width: [] for width in WIDTHS}
    with torch.no_grad():
        for sweep in range(sweeps):
            for width in WIDTHS:
                for _ in range(args.rounds):
                    rounds.flush()
                    round_ = rounds.greedy_round(width)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    started = time.perf_counter()
                    round_()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    if sweep:
                        times[width].append(time.perf_counter() - started)
    medians = {width: 1e3 * statistics.median(values) for width, values in times.items()}
    return {str(width): dict(round_ms=round(ms, 4), over_plain=round(ms / medians[0], 4))
            for width, ms in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter, prompts = load_models("code50m", getattr(torch, args.dtype), args.device)
    cells = {}
    for rows in args.rows:
        cells[str(rows)] = round_ms(target, drafter, prompts, rows, args)
        print(rows, cells[str(rows)], flush=True)
    result = dict(benchmark="round_widths", environment=environment(), settings=vars(args) | dict(out=str(args.out)),
                  rows=cells)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
