"""The 50M code fixture with its DSpark, DFlash and classic 10M assistant drafters (issue: evaluation harness).

    python benchmarks/eval_code50m.py [--prompts 10] [--max-new-tokens 64] [--device cpu]

Tasks: held-out CPython stdlib code prompts and HumanEval prompts (trailing whitespace stripped: the fixture's BPE
merges a newline with the following indent, so a bare trailing newline derails it), raw text (no chat template:
the fixture is a base code model), temperatures 0 and 1.0, γ = 7 for every drafter. Writes
benchmarks/results/eval_code50m.json (+ eval_code50m_*.png).
"""

from __future__ import annotations

import argparse
import json
import shutil

import torch
from common import (REPO, RESULTS, SHARED, environment, materialize_fixture, scratch_dir, stdlib_code_prompts,
                    write_json, write_report)
from transformers import AutoModelForCausalLM, AutoTokenizer

import dspark_hf
from dspark_hf.evaluation import load_task, plot_report, run_evaluation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10, help="prompts per task")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--threshold-sweep", default="",
                        help="only sweep these static thresholds (DSpark drafter, T=1.0, no baseline) and write "
                             "eval_code50m_threshold_sweep.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target_dir, assistant_dir = materialize_fixture("code-llama-50m"), materialize_fixture("code-llama-10m-assistant")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(args.device).eval()
    drafters = {
        name: dspark_hf.DSparkDraftModel.from_pretrained(REPO / "drafters" / f"code50m-{name}",
                                                         dtype=torch.float32).to(args.device).eval()
        for name in ("dspark", "dflash")
    }
    drafters["assistant_10m"] = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).to(
        args.device).eval()
    tasks = {
        "stdlib_code": stdlib_code_prompts(args.prompts),
        "humaneval": [p.rstrip() for p in load_task("humaneval", SHARED / "data", limit=args.prompts)],
    }
    if args.threshold_sweep:
        thresholds = [float(t) for t in args.threshold_sweep.split(",")]
        sweep = run_evaluation(target, tokenizer, {"dspark": drafters["dspark"]}, tasks, temperatures=[1.0],
                               max_new_tokens=args.max_new_tokens, chat=False, baseline=False,
                               threshold_sweep=thresholds)
        plots = scratch_dir()
        for path in plot_report(sweep, plots):
            if path.name == "threshold_sweep.png":
                shutil.copy(path, RESULTS / "eval_code50m_threshold_sweep.png")
        write_json("eval_code50m_threshold_sweep.json", {
            "what": "static confidence threshold sweep (the first slot whose conditional confidence is below the "
                    "threshold ends the verified prefix): acceptance rate of verified drafts and tau per task, "
                    "DSpark drafter for the 50M code fixture, T = 1.0",
            "environment": environment(), "device": args.device, "prompts_per_task": args.prompts,
            "max_new_tokens": args.max_new_tokens, "threshold_sweep": sweep["threshold_sweep"],
        })
        print(json.dumps(sweep["threshold_sweep"], indent=1))
        return
    report = run_evaluation(target, tokenizer, drafters, tasks, temperatures=[0.0, 1.0],
                            max_new_tokens=args.max_new_tokens, chat=False, gamma=7)
    write_report("eval_code50m", report, **{
        "what": "tau (accepted tokens per round incl. bonus, macro mean over tasks), per task: draft tokens per "
                "proposal, verify rate, accept_rate@k, conditional acceptance per position, tokens/s and speedup "
                "over plain decoding in the same run; target = 50M code fixture (float32), gamma = 7",
        "environment": environment(),
        "device": args.device,
        "prompts_per_task": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "drafters": {"dspark": "drafters/code50m-dspark", "dflash": "drafters/code50m-dflash",
                     "assistant_10m": "../shared/fixtures/code-llama-10m-assistant (transformers' assisted "
                                      "generation, 7 tokens per round, constant schedule)"},
    })
    print(report["tau"])


if __name__ == "__main__":
    main()
