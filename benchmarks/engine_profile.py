"""Where an engine round goes on the GPU (diagnostic): a random model of the 50M fixture's shape (bf16) with a
2-layer DSpark drafter, no speculation and fixed γ=7 at concurrency 1, 2 and 8 (32 tokens), each cell's round
breakdown (`serving.round_breakdown`), and torch.profiler tables for two cells.

    PYTHONPATH=src python benchmarks/engine_profile.py > benchmarks/results/engine_profile_h200.txt
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402

import dspark_hf  # noqa: E402
from dspark_hf.scheduling import SPSTable  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True, eos_token_id=2)
    with torch.device("cuda"):
        target = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        drafter = dspark_hf.DSparkDraftModel(dspark_hf.DSparkConfig.from_target_config(
            config, mask_token_id=3, num_hidden_layers=2, block_size=7, markov_rank=32,
            enable_confidence_head=True)).to(torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 49152, (int(n),), generator=generator).tolist()
               for n in torch.randint(100, 200, (64,), generator=generator)]
    args = argparse.Namespace(max_new_tokens=32, min_requests=4)
    sps = SPSTable.profile(target, batch_tokens=(1, 8, 64, 512), context_length=256, repeats=3, progress=False)
    with torch.inference_mode():
        for concurrency in (1, 2, 8):
            for setting in (dict(policy="none"), dict(policy="fixed", gamma=7)):
                serving.run_cell(target, drafter, prompts, concurrency, setting, args, sps)  # warm-up
                cell = serving.run_cell(target, drafter, prompts, concurrency, setting, args, sps)
                print(concurrency, setting, f"round {cell['round_ms']:.1f} ms tok/s {cell['tokens_per_second']:.0f}")
                breakdown = serving.round_breakdown(target, drafter, prompts, concurrency, setting, args, sps, None)
                print("   ", breakdown["ms_per_round"], flush=True)
        for concurrency, setting in ((2, dict(policy="none")), (8, dict(policy="fixed", gamma=7))):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                serving.run_cell(target, drafter, prompts, concurrency, setting, args, sps)
            print(f"===== c={concurrency} {setting}")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=70))


if __name__ == "__main__":
    main()
