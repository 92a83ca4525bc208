"""GPU check of the static-cache attention kernel: bf16 output vs transformers' SDPA attention at the Qwen3-4B shape,
and the 50M fixture's compiled fast path (plain and DSpark) with each attention setting, tokens and one warm call.

    PYTHONPATH=src python benchmarks/static_attention_check.py --out benchmarks/results/static_attention_check_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_speed  # noqa: E402

from dspark_hf.attention_backends import decoding_attention  # noqa: E402
from dspark_hf.generation import static_generate  # noqa: E402
from dspark_hf.generation.static_attention import static_cache_attention  # noqa: E402


def attention_errors() -> dict[str, float]:
    """Max |kernel - SDPA| for 1 and 8 queries over a 272-row cache at Qwen3-4B's heads (32 query, 8 K/V, 128)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    errors = {}
    for queries in (1, 8):
        module = types.SimpleNamespace(num_key_value_groups=4, is_causal=True)
        query = torch.randn(1, queries, 32, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
        query = query.transpose(1, 2)
        key = torch.randn(1, 8, 272, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
        value = torch.randn_like(key)
        positions = 130 + torch.arange(queries, device="cuda")
        mask = (torch.arange(272, device="cuda")[None, :] <= positions[:, None])[None, None]
        with decoding_attention():
            reference = sdpa_attention_forward(module, query, key, value, mask, scaling=0.088)[0]
            ours = static_cache_attention(module, query, key, value, mask, scaling=0.088)[0]
        errors[f"attn_n{queries}_max_abs_err"] = (ours.float() - reference.float()).abs().max().item()
    return errors


def fixture_runs(new_tokens: int = 128) -> dict:
    """The fixture's compiled plain and DSpark loops with attention "model" and "auto": ms of one warm call each,
    and whether each reproduced the tokens of plain decoding with the model's attention."""
    target, drafter, prompt = round_speed.models("code50m", torch.bfloat16, "cuda", new_tokens)
    results, tokens = {}, {}
    with torch.no_grad(), decoding_attention():
        for attention in ("model", "auto"):
            for name, model in (("plain", None), ("dspark", drafter)):
                def call():
                    return static_generate(target, model, prompt, new_tokens, eos_token_id=[], compile=True,
                                           attention=attention)
                call()
                torch.cuda.synchronize()
                started = time.perf_counter()
                tokens[name, attention] = call()[0, prompt.shape[1]:].tolist()
                torch.cuda.synchronize()
                results[f"{name}_{attention}_ms"] = 1e3 * (time.perf_counter() - started)
    for (name, attention), value in tokens.items():
        results[f"{name}_{attention}_identical_to_plain_model"] = value == tokens["plain", "model"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON path for the results (printed either way)")
    args = parser.parse_args()
    results = {**attention_errors(), **fixture_runs()}
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
