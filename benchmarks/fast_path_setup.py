"""The host's set-up per call of the fast path (`static_generate`, compiled or not), before any kernel runs.

`fast_path(...)` is entered and left as `static_generate` enters it: the models are checked, the drafter's embedding
and LM head shared from the target, the kept caches and round fetched, the projections' fusion checked, and the
captured graphs' validity key (every parameter's address) computed. Two ways of checking the fusion alternate, one
block of calls each, `--repeats` times:
- `record`: `fuse_projections` checks the groups it left at the last call (the library since 2026-12-07);
- `walk`: its record is cleared before every call, so it walks both models' modules as before.
The parts are timed alone too. Host milliseconds per call (median over the blocks), no device synchronisation.

    PYTHONPATH=src python benchmarks/fast_path_setup.py --model code50m --device cuda --out /tmp/setup.json
    PYTHONPATH=src python benchmarks/fast_path_setup.py --model smoke --device cpu     # any machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment  # noqa: E402
from round_speed import SHAPES, models  # noqa: E402

from dspark_hf.generation import fused_projections  # noqa: E402
from dspark_hf.generation.cuda_graphs import CaptureKey  # noqa: E402
from dspark_hf.generation.static_loop import fast_path  # noqa: E402


def ms_per_call(call: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return 1e3 * (time.perf_counter() - started) / calls


def measure(target, drafter, prompt_length: int, calls: int, repeats: int) -> dict:
    """Median host ms per call of the whole set-up (`record`, `walk`) and of its parts."""
    max_length = prompt_length + 128 + 2 * (drafter.config.block_size + 1)
    compile = target.device.type == "cuda"

    def enter_and_leave():
        with fast_path(target, drafter, max_length, compile, False, "auto", True):
            pass

    def walked():
        fused_projections._fused_groups.clear()
        enter_and_leave()

    key = CaptureKey()
    parts = {
        "fuse_projections_target": lambda: fused_projections.fuse_projections(target),
        "fuse_projections_drafter": lambda: fused_projections.fuse_projections(drafter),
        "share_target_weights": lambda: drafter.share_target_weights(target),
        "capture_key": lambda: key.changed((target, drafter), True, True),
    }
    enter_and_leave()  # builds the kept caches and fuses once
    times: dict[str, list[float]] = {name: [] for name in ("record", "walk", *parts)}
    for _ in range(repeats):
        times["record"].append(ms_per_call(enter_and_leave, calls))
        times["walk"].append(ms_per_call(walked, calls))
        for name, part in parts.items():
            times[name].append(ms_per_call(part, calls))
    return {name: statistics.median(values) for name, values in times.items()} | {"calls": calls, "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["code50m", *SHAPES], required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="JSON path (default: print only)")
    args = parser.parse_args()
    dtype = torch.float32 if args.model == "smoke" else getattr(torch, args.dtype)
    target, drafter, prompt = models(args.model, dtype, args.device)
    result = dict(benchmark="fast_path_setup", model=args.model, environment=environment(),
                  layers=target.config.num_hidden_layers, drafter_layers=drafter.config.num_hidden_layers,
                  ms_per_call=measure(target, drafter, prompt.shape[1], args.calls, args.repeats))
    print(json.dumps(result["ms_per_call"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
