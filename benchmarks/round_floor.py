"""The round's own weight-read floor for the committed H200 rows, without a GPU.

    PYTHONPATH=src:benchmarks python benchmarks/round_floor.py > benchmarks/results/round_floor_h200_rows_cpu.json

Counts the target's weight bytes and the drafter's but its input embedding (`round_speed.weight_read_floor`) on the
Qwen3-4B and 8B shapes' models built on the meta device, and divides the steady rounds of
`results/round_speed_h200.json` by the floors at that file's measured copy bandwidth. No new timing: newer
round_speed.py runs record the same keys (`round_floor_ms`, `round_time_over_round_floor_*`) themselves.
"""
import json
import sys

import torch

import round_speed

SOURCE = round_speed.RESULTS / "round_speed_h200.json"


def main() -> None:
    committed = json.loads(SOURCE.read_text())["models"]
    out = dict(command="python " + " ".join(sys.argv), source=str(SOURCE.relative_to(round_speed.REPO)), models={})
    for name in ("qwen3-4b-shape", "qwen3-8b-shape"):
        target, drafter, _ = round_speed.models(name, torch.bfloat16, "meta")
        row = committed[name]
        counted = round_speed.weight_read_floor(target, drafter, bandwidth=row["copy_bandwidth_bytes_per_s"])
        steady_ms = row["methods"]["dspark_static_compiled"]["ms_per_steady_round"]
        out["models"][name] = dict(
            **counted, ms_per_steady_round=steady_ms, round_time_over_floor=steady_ms / counted["floor_ms"],
            round_time_over_round_floor=steady_ms / counted["round_floor_ms"])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
