"""What one compiled round of the fast path costs on the GPU (diagnostic): kernels launched and their summed GPU time
per DSpark round and per plain step, from torch.profiler (CUPTI lists the kernels inside CUDA-graph replays) over one
timed call of `static_generate(..., compile=True)` after an identical warm-up call, greedy, eos off; for each
`--attention` and `--fuse-projections` setting of `static_generate` (settings other than auto suffix the rows; "off"
runs before "on", since fusing is kept on the models). `matched_first` is the share of the first row's tokens (of
the same kind, plain or DSpark) a row reproduced before its first difference.

    PYTHONPATH=src python benchmarks/static_round_profile.py --model code50m \
        --out benchmarks/results/static_round_profile_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_speed  # noqa: E402
from common import environment  # noqa: E402

import dspark_hf  # noqa: E402
from dspark_hf.devices import synchronize  # noqa: E402
from dspark_hf.generation import static_generate  # noqa: E402


def profiled(call, device: torch.device) -> tuple[dict, torch.Tensor]:
    """Wall seconds, kernel count and summed kernel time (ms) of `call()` after a warm-up call; and its output."""
    with torch.no_grad(), dspark_hf.decoding_attention():
        call()
        synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            output = call()
            synchronize(device)
            seconds = time.perf_counter() - started
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
    row = dict(wall_s=seconds, kernels=sum(e.count for e in kernels),
               kernel_ms=sum(e.self_device_time_total for e in kernels) / 1e3,
               top_kernels=[dict(name=e.key[:120], count=e.count, ms=e.self_device_time_total / 1e3) for e in top])
    return row, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["code50m", *round_speed.SHAPES], default="code50m")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "static_kernel", "model"],
                        help="static_generate's attention setting(s); a setting other than auto suffixes the rows")
    parser.add_argument("--fuse-projections", nargs="+", default=["auto"], choices=["auto", "off", "on"],
                        help="static_generate's fuse_projections setting(s) (auto: on CUDA); off/on suffix the rows")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    target, drafter, prompt = round_speed.models(args.model, dtype, args.device, args.new_tokens)
    compile = target.device.type == "cuda"
    rows, first = {}, {}
    fusing = sorted(args.fuse_projections, key=["off", "auto", "on"].index)
    for fuse, attention in itertools.product(fusing, args.attention):
        suffix = ("" if attention == "auto" else f"_{attention}") + ("" if fuse == "auto" else f"_fuse_{fuse}")
        for name, model in (("plain_static_compiled", None), ("dspark_static_compiled", drafter)):
            row, output = profiled(lambda: static_generate(target, model, prompt, args.new_tokens, eos_token_id=[],
                                                           compile=compile, attention=attention,
                                                           fuse_projections={"auto": None, "on": True,
                                                                             "off": False}[fuse]), target.device)
            steps = drafter.generation_stats.rounds if model is not None else args.new_tokens - 1
            reference = first.setdefault(name, output[0])
            row.update(steps=steps, kernels_per_step=row["kernels"] / steps,
                       kernel_ms_per_step=row["kernel_ms"] / steps, wall_ms_per_step=1e3 * row["wall_s"] / steps,
                       matched_first=round_speed.first_difference_share(output[0], reference))
            rows[name + suffix] = row
            print(name + suffix, {k: round(v, 3) for k, v in row.items() if isinstance(v, (int, float))}, flush=True)
    payload = dict(benchmark="static_round_profile", model=args.model, environment=environment(),
                   new_tokens=args.new_tokens, steps="plain: tokens after the first; dspark: all rounds (the first "
                   "is eager only after a prompt of at most γ + 1 tokens)", methods=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
