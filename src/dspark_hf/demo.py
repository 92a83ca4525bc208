"""`dspark-hf demo`: an offline side-by-side of plain decoding and DSpark on a model pair available locally.

With `--target/--drafter` it runs any pair (Hub ids when online). Without them it builds a tiny random-init
Qwen3 target and drafter in memory: that shows the machinery and its losslessness, not a speedup (an untrained
drafter accepts almost nothing).
"""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from .evaluation import compare_generation
from .models import DSparkConfig, DSparkDraftModel


def tiny_random_pair(seed: int = 0) -> tuple[Qwen3ForCausalLM, DSparkDraftModel]:
    """A 4-layer random Qwen3 target and a 2-layer random DSpark drafter sized for it."""
    torch.manual_seed(seed)
    target_config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=None)
    target = Qwen3ForCausalLM(target_config).eval()
    drafter_config = DSparkConfig.from_target_config(target_config, mask_token_id=255, num_hidden_layers=2,
                                                     markov_rank=16, block_size=7)
    return target, DSparkDraftModel(drafter_config).eval()


def run_demo(args: argparse.Namespace) -> int:
    """Decodes one prompt both ways and prints outputs, speeds, τ and acceptance per position."""
    if args.target or args.drafter:
        from .cli import cmd_generate

        return cmd_generate(args)
    target, drafter = tiny_random_pair()
    input_ids = torch.tensor([[1, 17, 42, 99, 7]])
    result = compare_generation(target, drafter, input_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    print("tiny random-init pair (no trained weights on this machine): plain vs DSpark, greedy")
    print("plain :", result.plain_ids[0, result.prompt_length:].tolist())
    print("DSpark:", result.dspark_ids[0, result.prompt_length:].tolist())
    print(f"identical: {result.identical}; tau {result.stats.tau:.2f} over {result.stats.rounds} rounds; "
          f"plain {result.plain_tokens_per_second:.0f} tok/s, DSpark {result.dspark_tokens_per_second:.0f} tok/s")
    return 0 if result.identical else 1
