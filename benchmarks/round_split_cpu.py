"""CPU time per DSpark round, split into draft / verify, on the 50M code fixture with a random-init drafter.

    python benchmarks/round_split_cpu.py [--prompts 5] [--max-new-tokens 64]

A random-init drafter accepts almost nothing (τ ≈ 1), so this measures the cost structure of a round, not a
speedup. Writes benchmarks/results/round_split_code50m_cpu.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import environment, materialize_fixture, stdlib_code_prompts, write_json
from transformers import AutoModelForCausalLM, AutoTokenizer

import dspark_hf
from dspark_hf.evaluation import compare_generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    folder = materialize_fixture("code-llama-50m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(0)
    config = dspark_hf.DSparkConfig.from_target_config(
        target.config, mask_token_id=tokenizer.pad_token_id or 0, num_hidden_layers=3, markov_rank=32, block_size=7
    )
    drafter = dspark_hf.DSparkDraftModel(config).eval()
    drafter.weights_from_target = {"embed_tokens", "lm_head"}  # use the target's, as a trained drafter would

    rows = []
    prompts = stdlib_code_prompts(args.prompts)
    warm = tokenizer(prompts[0], return_tensors="pt")["input_ids"]
    compare_generation(target, drafter, warm, max_new_tokens=8, do_sample=False)
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        result = compare_generation(target, drafter, ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        stats = result.stats
        rows.append({
            "prompt_tokens": ids.shape[1],
            "identical_to_plain": result.identical,
            "rounds": stats.rounds,
            "tau": stats.tau,
            "draft_ms_per_round": 1e3 * statistics.mean(stats.draft_seconds),
            "verify_ms_per_round": 1e3 * statistics.mean(stats.verify_seconds),
            "plain_tokens_per_s": result.plain_tokens_per_second,
            "dspark_tokens_per_s": result.dspark_tokens_per_second,
        })
        print(rows[-1])
    summary = {key: statistics.mean(r[key] for r in rows) for key in rows[0] if key != "identical_to_plain"}
    summary["all_identical"] = all(r["identical_to_plain"] for r in rows)
    write_json("round_split_code50m_cpu.json", {
        "what": "CPU time per DSpark round (draft = drafter forward + Markov loop + sampling; verify = target "
                "forward over the l+1 tokens, acceptance and transformers' bookkeeping), 50M code fixture target "
                "(float32), random-init 3-layer drafter (gamma 7, markov rank 32), greedy, held-out CPython stdlib code prompts (30 lines ending at a def)",
        "environment": environment(),
        "max_new_tokens": args.max_new_tokens,
        "summary": summary,
        "per_prompt": rows,
    })


if __name__ == "__main__":
    main()
