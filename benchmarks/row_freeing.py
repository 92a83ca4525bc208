"""Host time of the static engine's row upkeep: `StaticRows.remove` (freeing the rows of finished requests) and the
sampling settings an admission writes (`StaticRows._set_sampling`), per call, on the current device.

    PYTHONPATH=src:benchmarks python benchmarks/row_freeing.py --device cuda --out row_freeing.json

A tiny random float32 Qwen3 target and DSpark drafter (`serving.tiny_models`; the upkeep does not depend on the
model) serve `--rows` rows, eager (no graphs: the upkeep runs outside them). Each trial fills every row, runs one
round, synchronizes, then times `remove` of k rows (k in `--freed`) on the host, as `DSparkEngine.step` calls it
after a round's tokens came back (the device idle); then the device work it queued, and the next admission's
`_set_sampling` for k greedy or k sampled requests. Reported: the median and 10th / 90th percentiles over `--trials`
trials, in µs. `sync_probe`: the host time of `torch.tensor(values, device=...)` and of `to_device` with ~50 ms of
device work queued before them (whether each waits for it). `primitives`: the host time of the device writes a row's
freeing may use, with the device idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types

import torch
from common import environment
from serving import tiny_models

from dspark_hf.generation.speculative_rows import Row
from dspark_hf.generation.static_rows import StaticRows
from dspark_hf.serving.engine import RequestSampler
from dspark_hf.serving.requests import SamplingParams


def _rows(prompts: list[list[int]], count: int, sampled: bool) -> list[Row]:
    params = SamplingParams(temperature=0.7, top_k=20) if sampled else SamplingParams(temperature=0.0)
    return [Row(ids=list(prompts[i % len(prompts)]), prompt_len=len(prompts[i % len(prompts)]), max_new=32,
                tag=types.SimpleNamespace(params=params)) for i in range(count)]


def _spread(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"median_us": round(1e6 * statistics.median(ordered), 2),
            "p10_us": round(1e6 * ordered[len(ordered) // 10], 2),
            "p90_us": round(1e6 * ordered[(9 * len(ordered)) // 10], 2)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_upkeep(device: torch.device, rows: int, freed: list[int], trials: int) -> list[dict]:
    target, drafter, prompts = tiny_models()
    target, drafter = target.to(device), drafter.to(device)
    runner = StaticRows(target, drafter, rows, 64, verify=3, sampler=RequestSampler(torch.Generator(device)))
    results = []
    for count in freed:
        for sampled in (False, True):
            removes, queued, settings = [], [], []
            for _ in range(trials):
                running = _rows(prompts, rows - len(runner.rows), sampled)
                runner.add(running)
                runner.step()
                _sync(device)
                gone = runner.rows[:count]
                start = time.perf_counter()
                runner.remove(gone)
                removes.append(time.perf_counter() - start)
                _sync(device)
                queued.append(time.perf_counter() - start)
                joining = _rows(prompts, count, sampled)
                slots = [index for index, owner in enumerate(runner.owner) if owner is None][:count]
                start = time.perf_counter()
                runner._set_sampling(slots, joining)
                settings.append(time.perf_counter() - start)
                _sync(device)
                runner.remove(runner.rows)
            results.append({"freed": count, "sampled": sampled, "remove": _spread(removes),
                            "remove_and_its_device_work": _spread(queued), "set_sampling": _spread(settings)})
            print(json.dumps(results[-1]), flush=True)
    return results


def sync_probe(device: torch.device, trials: int) -> dict | None:
    """Host time of a few values put on the device behind ~50 ms of queued device work."""
    if device.type != "cuda":
        return None
    try:
        from dspark_hf.tensor_ops import to_device
    except ImportError:  # a library before to_device
        to_device = None
    probes = {"torch.tensor(device=...)": lambda: torch.tensor([1, 2, 3], device=device)}
    if to_device is not None:
        probes["to_device"] = lambda: to_device([1, 2, 3], device, torch.long)
    return _host_times(device, probes, trials, queued=lambda: torch.cuda._sleep(50_000_000))


def primitives(device: torch.device, trials: int) -> dict | None:
    """Host time, the device idle, of the writes `remove` may use on a 64-row buffer (one row or four)."""
    if device.type != "cuda":
        return None
    try:
        from dspark_hf.tensor_ops import to_device
    except ImportError:
        return None
    active = torch.ones(64, dtype=torch.long, device=device)
    one, four = to_device([5], device, torch.long), to_device([5, 9, 17, 40], device, torch.long)
    probes = {
        "to_device 1 value": lambda: to_device([5], device, torch.long),
        "to_device 4 values": lambda: to_device([5, 9, 17, 40], device, torch.long),
        "torch.tensor(device=...) 1 value": lambda: torch.tensor([5], device=device),
        "active[5] = 0": lambda: active.__setitem__(5, 0),
        "active[5:6].fill_(0)": lambda: active[5:6].fill_(0),
        "index_fill_ (1 row, index on the device)": lambda: active.index_fill_(0, one, 0),
        "index_fill_ (4 rows, index on the device)": lambda: active.index_fill_(0, four, 0),
        "active[index] = 0 (4 rows, index on the device)": lambda: active.__setitem__(four, 0),
        "to_device + index_fill_ (1 row)": lambda: active.index_fill_(0, to_device([5], device, torch.long), 0),
    }
    return _host_times(device, probes, trials)


def _host_times(device: torch.device, probes: dict, trials: int, queued=lambda: None) -> dict:
    """Each probe's host time over `trials` calls, the device synchronized before each and `queued` called then."""
    result = {}
    for name, probe in probes.items():
        times = []
        for _ in range(trials):
            _sync(device)
            queued()
            start = time.perf_counter()
            probe()
            times.append(time.perf_counter() - start)
        result[name] = _spread(times)
    _sync(device)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--freed", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--label", default="", help="a name for the library measured (kept in the JSON)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    report = {"label": args.label, "device": str(device), "rows": args.rows, "trials": args.trials,
              "command": " ".join(["python benchmarks/row_freeing.py", *sys.argv[1:]]),
              "environment": environment(), "upkeep": time_upkeep(device, args.rows, args.freed, args.trials),
              "sync_probe": sync_probe(device, 20), "primitives": primitives(device, 200)}
    print(json.dumps(report["sync_probe"]))
    print(json.dumps(report["primitives"], indent=1))
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
