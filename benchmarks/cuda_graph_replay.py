"""What the host pays per compiled round: reduce-overhead's CUDA-graph trees against one directly captured CUDA graph
(GPU diagnostic).

    PYTHONPATH=src python benchmarks/cuda_graph_replay.py --model code50m qwen3-4b-shape \
        --out benchmarks/results/cuda_graph_replay_h200.json

For each model, plain steps and greedy DSpark rounds of `static_generate`'s fast path (batch 1, bf16, caches of
prompt + 3000 positions, so that 40 rounds of any acceptance fit), from the same start (prompt prefilled, first token
taken) each time:
- `trees_queued`: `torch.compile(step, mode="reduce-overhead")` called 40 times without reading the device, then one
  synchronisation: `host_ms` is the host's time per call, `gpu_ms` the device time per round between two CUDA events
  (it includes the device's waits for the host when the host is slower), `wall_ms` the whole;
- `trees_sync_each`: the same with one read of the device after each round (as a loop that must see each round);
- `direct_queued` / `direct_sync_each`: `torch.compile(step)` (no graphs of its own) warmed up three times on a side
  stream, captured once with `torch.cuda.graph`, then `graph.replay()` per round;
- `direct_matches_trees_rows`: of the 40 rounds' records (accepted count and tokens), how many the replays reproduce;
  `trees_again` repeats `trees_queued` after the capture, `trees_again_matches_rows` likewise;
- `steady_round_ms` (DSpark): `static_generate(..., compile=True)` as the library runs it, on the same kept caches,
  after a warm-up call, 128 tokens with eos off: the rounds after the first (its round statistics), as
  `round_speed.py` reports it (whose caches are shorter: prompt + 144 positions).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_speed  # noqa: E402
from common import RESULTS, environment  # noqa: E402

import dspark_hf  # noqa: E402
from dspark_hf.generation import static_generate  # noqa: E402
from dspark_hf.generation.static_loop import StaticRound, fast_path, rewind, start_dspark_rounds  # noqa: E402

ROUNDS = 40
EXTRA_POSITIONS = 3000


def start(rounds: StaticRound, drafter, prompt: torch.Tensor) -> None:
    """Empties both caches, prefills `prompt` and sets the state buffers for the first queued round."""
    zero = torch.zeros((), dtype=torch.long, device=prompt.device)
    rounds.verifier.rollback(zero)
    if rounds.drafter_cache is not None:
        rewind(rounds.drafter_cache, zero)
    state = rounds.prefill(prompt)
    first = state.logits.argmax(dim=-1)
    position = torch.tensor(prompt.shape[1], device=prompt.device)
    if drafter is None:
        rounds.start_greedy(first, position)
    elif start_dspark_rounds(rounds, first, state, position) is not None:
        raise ValueError("the prompt must be longer than γ + 1 tokens (a compiled first round)")


def timed(call: Callable[[], object], calls: int) -> dict[str, float]:
    """Host ms per call, device ms per call between two events, wall ms per call (one synchronisation at the end)."""
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    host = time.perf_counter() - started
    end.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    return dict(host_ms=1e3 * host / calls, gpu_ms=begin.elapsed_time(end) / calls, wall_ms=1e3 * wall / calls)


def captured(step: Callable[[], None], warmup: int = 3) -> torch.cuda.CUDAGraph:
    """`step` (compiled, in place) run `warmup` times on a side stream, then captured as one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def measure(name: str) -> dict:
    target, drafter, prompt = round_speed.models(name, torch.bfloat16, "cuda")
    entry = {}
    with torch.no_grad(), dspark_hf.decoding_attention():
        for label, model in (("plain", None), ("dspark", drafter)):
            row = entry[label] = {}
            # (compile=True: the kept instance that static_generate(compile=True) reuses below)
            with fast_path(target, model, prompt.shape[1] + EXTRA_POSITIONS, True, False) as rounds:
                tapping = rounds.verifier.tapping
                started = time.perf_counter()
                trees = torch.compile(rounds.step, mode="reduce-overhead", dynamic=False)
                start(rounds, model, prompt)
                with tapping():
                    for _ in range(3):
                        trees()
                torch.cuda.synchronize()
                row["trees_compile_s"] = time.perf_counter() - started
                start(rounds, model, prompt)
                with tapping():
                    row["trees_queued"] = timed(trees, ROUNDS)
                reference = rounds.record[:ROUNDS].clone()
                start(rounds, model, prompt)
                with tapping():
                    row["trees_sync_each"] = timed(lambda: (trees(), rounds.record[0].tolist()), ROUNDS)
                started = time.perf_counter()
                direct = torch.compile(rounds.step, dynamic=False)
                start(rounds, model, prompt)
                with tapping():
                    graph = captured(direct)
                torch.cuda.synchronize()
                row["direct_build_s"] = time.perf_counter() - started
                start(rounds, model, prompt)
                row["direct_queued"] = timed(graph.replay, ROUNDS)
                row["direct_matches_trees_rows"] = int((rounds.record[:ROUNDS] == reference).all(dim=1).sum())
                start(rounds, model, prompt)
                row["direct_sync_each"] = timed(lambda: (graph.replay(), rounds.record[0].tolist()), ROUNDS)
                start(rounds, model, prompt)
                with tapping():
                    row["trees_again"] = timed(trees, ROUNDS)
                row["trees_again_matches_rows"] = int((rounds.record[:ROUNDS] == reference).all(dim=1).sum())
            if model is not None:
                for _ in range(2):  # a warm-up call, then the measured one
                    static_generate(target, model, prompt, 128, eos_token_id=[], compile=True)
                stats = model.generation_stats
                row.update(steady_round_ms=1e3 * sum(stats.verify_seconds[1:]) / (stats.rounds - 1),
                           rounds=stats.rounds)
            print(name, label, json.dumps(row), flush=True)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=["code50m", *round_speed.SHAPES], default=["code50m"])
    parser.add_argument("--out", default=str(RESULTS / "cuda_graph_replay_h200.json"))
    args = parser.parse_args()
    payload = dict(benchmark="cuda_graph_replay", environment=environment(), rounds=ROUNDS,
                   cache_positions=f"prompt + {EXTRA_POSITIONS}", models={name: measure(name) for name in args.model})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
