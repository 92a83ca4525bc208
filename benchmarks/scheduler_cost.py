"""Per-call cost of the verify-length policies (dspark_hf.scheduling) for R requests x gamma drafts.

    python benchmarks/scheduler_cost.py --device cpu --out benchmarks/results/scheduler_cost_cpu.json

Confidences are synthetic (per-slot conditional acceptance ~ sigmoid(N(2 - 0.25 k, 1.5))); the SPS curve
is a synthetic GPU-like one (flat, then ~1/B). The policies' cost does not depend on the curve's values
(the vectorised paths evaluate the whole candidate path either way). A literal Python loop of Algorithm 1
is timed alongside for reference.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch

from dspark_hf.scheduling import (
    SPSTable,
    async_capacity,
    fixed_length,
    hardware_aware_async,
    hardware_aware_sync,
    static_threshold,
    top_k_prefix,
)


def algorithm1_python_loop(conf: torch.Tensor, sps: SPSTable) -> torch.Tensor:
    """Reference: Algorithm 1 one candidate at a time (as written in the paper)."""
    r, g = conf.shape
    a = conf.double().cumprod(-1).cpu().tolist()
    cands = sorted((-a[i][k], k, i) for i in range(r) for k in range(g) if a[i][k] > 0)
    l, best, b, tau = [0] * r, [0] * r, r, float(r)
    theta_best = tau * sps(b)
    for neg_a, k, i in cands:
        l[i], b, tau = k + 1, b + 1, tau - neg_a
        theta = tau * sps(b)
        if theta < theta_best:
            break
        theta_best, best = theta, list(l)
    return torch.tensor(best)


def synthetic_sps() -> SPSTable:
    bs = [2**i for i in range(13)]  # 1 .. 4096 tokens
    return SPSTable(bs, [60.0 / (1.0 + (b / 512.0) ** 1.2) for b in bs], 2048, "synthetic", "synthetic", "bf16")


def time_call(fn, device: torch.device, warmup: int, repeats: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ts.append((time.perf_counter() - t0) * 1e6)
    ts.sort()
    return {
        "median_us": statistics.median(ts),
        "p10_us": ts[int(0.1 * (len(ts) - 1))],
        "p90_us": ts[int(0.9 * (len(ts) - 1))],
        "mean_us": statistics.fmean(ts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/scheduler_cost_<device>.json)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    r, g = args.requests, args.gamma
    mu = 2.0 - 0.25 * torch.arange(g, dtype=torch.float32)
    conf = torch.sigmoid(mu + 1.5 * torch.randn(r, g, generator=gen)).to(device)
    stale = torch.sigmoid(mu + 1.5 * torch.randn(r, g, generator=gen)).to(device)
    caps = torch.randint(g - 2, g + 1, (r,), generator=gen).to(device)
    sps = synthetic_sps()
    k_stale = async_capacity(stale, sps)

    cases = {
        "fixed_length": lambda: fixed_length(conf, g),
        "static_threshold": lambda: static_threshold(conf, 0.5),
        "hardware_aware_sync": lambda: hardware_aware_sync(conf, sps),
        "hardware_aware_sync_max_lengths": lambda: hardware_aware_sync(conf, sps, max_lengths=caps),
        "hardware_aware_async_full": lambda: hardware_aware_async(stale, conf, sps),
        "async_capacity_only": lambda: async_capacity(stale, sps),
        "async_topk_only": lambda: top_k_prefix(conf, k_stale),
        "reference_python_loop_algorithm1": lambda: algorithm1_python_loop(conf, sps),
    }
    results = {}
    for name, fn in cases.items():
        out = fn()
        entry = time_call(fn, device, args.warmup, args.repeats if "loop" not in name else max(5, args.repeats // 10))
        if isinstance(out, torch.Tensor):
            entry["verify_tokens_total"] = int(out.sum())
            entry["mean_verify_length"] = float(out.double().mean())
        else:
            entry["capacity"] = int(out)
        results[name] = entry
        print(f"{name:36s} median {entry['median_us']:9.1f} us  p90 {entry['p90_us']:9.1f} us")
    assert torch.equal(hardware_aware_sync(conf, sps).cpu(), algorithm1_python_loop(conf, sps))

    record = {
        "benchmark": "scheduler_cost",
        "command": " ".join(shlex.quote(a) for a in [sys.executable.split(os.sep)[-1]] + sys.argv),
        "pythonpath": os.environ.get("PYTHONPATH"),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "setup": {"requests": r, "gamma": g, "device": str(device), "warmup": args.warmup,
                  "repeats": args.repeats, "seed": args.seed, "confidence_dtype": str(conf.dtype),
                  "sps_table": sps.to_dict()},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_1_5_15min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "results": results,
    }
    out_path = args.out or os.path.join(os.path.dirname(__file__), "results", f"scheduler_cost_{device.type}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
