"""Where a fast-path round goes, stage by stage: `dspark_hf.generation.profile_static_round` on the fixture or a random
shape (greedy, batch 1, bf16, compiled on CUDA with static_generate's defaults). Each model's entry replaces its old
one in `--out`; a stacked-bar plot goes next to it.

    PYTHONPATH=src python benchmarks/round_stages.py --model code50m --out benchmarks/results/round_stages_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_speed  # noqa: E402
from common import environment  # noqa: E402

import dspark_hf  # noqa: E402
from dspark_hf.generation import profile_static_round  # noqa: E402
from dspark_hf.generation.static_profile import ROUND_STAGES  # noqa: E402


def measure(name: str, dtype: torch.dtype, device: str, rounds: int) -> dict:
    target, drafter, prompt = round_speed.models(name, dtype, device)
    with dspark_hf.decoding_attention():
        profile = profile_static_round(target, drafter, prompt, rounds=rounds, compile=target.device.type == "cuda")
    entry = dict(profile.as_dict(), prompt_tokens=prompt.shape[1], dtype=str(dtype).replace("torch.", ""),
                 split_over_fused=profile.split_round / profile.fused_round)
    floor_ms = round_speed.weight_read_floor(target, drafter)["floor_ms"]
    if floor_ms:
        entry["floor_ms"] = floor_ms
    return entry


def plot(models: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []  # (label, stage ms, fused ms): event times, and the profiler's GPU time where there is one
    for name, entry in models.items():
        bars.append((f"{name}\nevents", entry["stages_ms"], entry["fused_round_ms"]))
        gpu = entry.get("gpu_kernel_ms")
        if gpu:
            bars.append((f"{name}\nGPU", {stage: gpu[stage] for stage in ROUND_STAGES}, gpu["fused"]))
    labels = [label for label, _, _ in bars]
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(bars), 4.5))
    bottoms = [0.0] * len(bars)
    for stage in ROUND_STAGES:
        values = [stages[stage] for _, stages, _ in bars]
        ax.bar(labels, values, bottom=bottoms, label=stage)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.scatter(labels, [fused for _, _, fused in bars], marker="_", s=900, color="black",
               label="fused round (as static_generate runs it)", zorder=3)
    ax.set_ylabel("ms per greedy DSpark round")
    ax.set_title("Fast-path round split into stages (one CUDA graph each):\nCUDA events vs the profiler's GPU time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["code50m", *round_speed.SHAPES], required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    entry = measure(args.model, getattr(torch, args.dtype), args.device, args.rounds)
    entry["environment"] = environment()
    out = Path(args.out)
    payload = json.loads(out.read_text()) if out.exists() else dict(benchmark="round_stages", models={})
    payload["models"][args.model] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    plot(payload["models"], out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in entry.items() if k != "environment"}, indent=1))


if __name__ == "__main__":
    main()
