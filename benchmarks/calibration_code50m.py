"""Confidence calibration (Sequential Temperature Scaling) of the trained DSpark drafter for the 50M code fixture.

    python benchmarks/calibration_code50m.py [--prompts 120] [--max-new-tokens 48] [--temperature 1.0]

Rollouts: HumanEval prompts (trailing whitespace stripped), the 50M code fixture as target (float32), the
committed drafter `drafters/code50m-dspark`, every drafted token verified. STS is fitted on 70 % of the prompts and
scored on the other 30 %. Writes benchmarks/results/calibration.json (+ calibration_reliability.png).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from common import REPO, RESULTS, environment, humaneval_prompts, materialize_fixture, scratch_dir, write_json
from transformers import AutoModelForCausalLM, AutoTokenizer

import dspark_hf
from dspark_hf.evaluation import calibrate_drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=120)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--drafter", default=str(REPO / "drafters" / "code50m-dspark"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    folder = materialize_fixture("code-llama-50m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device).eval()
    drafter = dspark_hf.DSparkDraftModel.from_pretrained(args.drafter, dtype=torch.float32).to(args.device).eval()
    prompts = [tokenizer(p.rstrip(), return_tensors="pt")["input_ids"] for p in humaneval_prompts(args.prompts)]
    out = scratch_dir("calibration-")
    try:
        import matplotlib  # noqa: F401  (absent on some GPU machines: then plot later from the saved records)
        plot = True
    except ImportError:
        plot = False
    metrics = calibrate_drafter(target, drafter, prompts, args.temperature, out, max_new_tokens=args.max_new_tokens,
                                plot=plot)
    shutil.copy(out / "records.safetensors", RESULTS / "calibration_records.safetensors")
    if plot:
        shutil.copy(out / "reliability.png", RESULTS / "calibration_reliability.png")
    ece = lambda report: [p["ece"] for p in report["positions"]]  # noqa: E731
    auc = lambda report: [p["auc"] for p in report["positions"]]  # noqa: E731
    write_json("calibration.json", {
        "what": "ECE (20 equal-width bins), ROC-AUC and Brier per draft position of the cumulative survival "
                "prod_{j<=k} c_j against the accepted-prefix labels, on held-out prompts, before (raw confidence "
                "head) and after Sequential Temperature Scaling fitted on the other prompts",
        "environment": environment(),
        "target": f"code-llama-50m fixture (float32, {args.device})",
        "drafter": str(Path(args.drafter).relative_to(REPO)) if args.drafter.startswith(str(REPO)) else args.drafter,
        "prompts": f"HumanEval, first {args.prompts}, trailing whitespace stripped",
        "ece_raw": ece(metrics["raw"]),
        "ece_sts": ece(metrics["sts"]),
        "ece_raw_mean": metrics["raw"]["mean_ece"],
        "ece_sts_mean": metrics["sts"]["mean_ece"],
        "auc_raw": auc(metrics["raw"]),
        "auc_sts": auc(metrics["sts"]),
        **{key: metrics[key] for key in ("temperature", "max_new_tokens", "rounds", "sts_temperatures")},
        "prompt_split": metrics["prompts"],
        "raw": metrics["raw"],
        "sts": metrics["sts"],
    })
    print(f"mean ECE raw {metrics['raw']['mean_ece']:.4f} -> STS {metrics['sts']['mean_ece']:.4f}")


if __name__ == "__main__":
    main()
