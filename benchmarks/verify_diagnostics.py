"""GPU diagnostics of the Triton verify kernel (timing-only companions of verify_kernel.py).

    PYTHONPATH=src python benchmarks/verify_diagnostics.py launch-grid OUT.json
    PYTHONPATH=src python benchmarks/verify_diagnostics.py group-sizes OUT.json

launch-grid: (1) stress: 300 eager calls and 300 CUDA-graph replays per case must give the torch
reference's tokens (the race kernel's last-program ticket and the dependent launch under real
concurrency); (2) CUDA-graph median time at batch 64, V = 151,936, l in {1, 4, 7, 15}, bf16 and
fp32, for stats / race programs per SM and dependent launch on/off, 3 interleaved repeats.
group-sizes: the same timing at batch 64, bf16, l in {1, 4, 7} for several ``rng.RACE_GROUP``
values, with per-kernel GPU times (the group size changes which token a seed draws, not the
distribution: timing only).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
import verify_kernel as vk  # noqa: E402

from dspark_hf.verify import rng, verify  # noqa: E402
from dspark_hf.verify import triton_kernel as tk  # noqa: E402

STRESS_CASES = [  # batch, l, logits dtype, sampling arguments
    (64, 4, torch.bfloat16, {}),
    (8, 7, torch.float32, {}),
    (64, 7, torch.bfloat16, vk.FILTERED),
    (256, 1, torch.bfloat16, {}),
    (3, 15, torch.bfloat16, "mixed"),
]


def timed(shape, l: int) -> float:
    d, nd, logits, q, seeds = shape
    return round(vk.graph_time(lambda: verify(d, nd, logits, q, seeds=seeds, max_draft_len=l, backend="triton"), 20)
                 * 1000, 2)


def stress() -> list[dict]:
    out = []
    for b, l, dt, kw in STRESS_CASES:
        if kw == "mixed":
            kw = dict(do_sample=torch.arange(b, device="cuda") % 2 == 0)
        d, nd, logits, q, seeds = vk.make_inputs(b, l, dt, seed=3)
        call = lambda: verify(d, nd, logits, q, seeds=seeds, max_draft_len=l, backend="triton", **kw)  # noqa: E731
        ref = verify(d, nd, logits, q, seeds=seeds, max_draft_len=l, backend="torch", **kw).output_tokens
        eager_bad = sum(int((call().output_tokens != ref).any(-1).sum()) for _ in range(300))
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            call()
        torch.cuda.current_stream().wait_stream(st)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            graph_out = call().output_tokens
        graph_bad = 0
        for _ in range(300):
            g.replay()
            graph_bad += int((graph_out != ref).any(-1).sum())
        out.append(dict(b=b, l=l, dtype=str(dt), kw=str(kw), calls=300, mismatched_request_calls=eager_bad,
                        graph_replays=300, graph_mismatched_request_replays=graph_bad))
        print("stress", out[-1], flush=True)
    return out


def launch_grid() -> dict:
    shapes = {f"{str(dt)[6:]}/l={l}": vk.make_inputs(64, l, dt) for dt in (torch.bfloat16, torch.float32)
              for l in (1, 4, 7, 15)}
    base = tk.get_launch_config()
    cfgs = {f"stats_pps={sp}/race_pps={rp}/pdl={pdl}":
            replace(base, stats_programs_per_sm=sp, race_programs_per_sm=rp, dependent_launch=pdl)
            for sp in (4, 6) for rp in (8, 16) for pdl in (False, True)}
    grid: dict = {}
    try:
        for _ in range(3):
            for name, cfg in cfgs.items():
                tk.set_launch_config(cfg)
                row = grid.setdefault(name, {})
                for sname, shape in shapes.items():
                    row.setdefault(sname, []).append(timed(shape, int(sname.split("=")[1])))
    finally:
        tk.set_launch_config(base)
    for name, row in grid.items():
        med = {k: sorted(v)[1] for k, v in row.items()}
        print(name, "sum", round(sum(med.values()), 1), med, flush=True)
    return dict(default=base.as_dict(), stress=stress(), grid_us=grid)


def group_sizes() -> dict:
    out = {}
    default = rng.RACE_GROUP
    try:
        for G in (512, 1024, 2048, 4096):
            rng.RACE_GROUP = G
            for l in (1, 4, 7):
                shape = vk.make_inputs(64, l, torch.bfloat16)
                cell = out[f"G={G}/l={l}"] = dict(graph_ms=timed(shape, l) / 1000,
                                                  kernels_us=vk.kernel_breakdown_us(*shape, l))
                print(G, l, cell, flush=True)
    finally:
        rng.RACE_GROUP = default
    return out


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    result = {"launch-grid": launch_grid, "group-sizes": group_sizes}[mode]()
    result = dict(command="PYTHONPATH=src python " + " ".join(sys.argv), gpu=torch.cuda.get_device_name(),
                  torch=torch.__version__, result=result)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
