"""A 4-bit NF4 (bitsandbytes) Qwen3-8B-shaped target with a DSpark drafter of matching shape: memory and batch-1
tokens/s with vs without DSpark (random weights: timing only, see `big_common.py` for the τ ≈ 1 run, the projection
and the trace-driven acceptance).

    # H200 (bitsandbytes carried, see docs/big_targets.md): writes benchmarks/results/quantized_h200.json
    python benchmarks/quantized.py --out benchmarks/results/quantized_h200.json
    # CPU smoke run, tiny shapes, bitsandbytes' CPU backend (writes to a temp file; never commit it)
    python benchmarks/quantized.py --tiny

The target is saved once in bf16 (random init) and loaded with `BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bfloat16)`, the way a user loads a 4-bit model; the drafter stays
bf16 and shares the target's (unquantized) embedding and LM head.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from big_common import (PAPER_TAU_QWEN3_8B, describe, fixture_tau, measure, memory, own_bytes,  # noqa: E402
                        qwen3_config, random_checkpoint, random_drafter, random_prompt)
from common import environment, scratch_dir  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

import dspark_hf  # noqa: E402,F401


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke test)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tiny:
        args.new_tokens, args.prompt_tokens = min(args.new_tokens, 24), min(args.prompt_tokens, 16)
    out = Path(args.out or tempfile.mkstemp(suffix="-quantized.json")[1])
    cuda = torch.cuda.is_available() and not args.tiny
    dtype = torch.bfloat16 if cuda else torch.float32

    config = qwen3_config(args.tiny)
    folder = scratch_dir("random-target-")
    checkpoint = random_checkpoint(config, dtype, folder)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    target = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, dtype=dtype,
                                                  device_map={"": 0} if cuda else "cpu").eval()
    loaded = {"target_footprint_gib": target.get_memory_footprint() / 2**30, "memory": memory()}
    drafter = random_drafter(config, dtype, args.tiny)

    taus = {"fixture_code50m_t0": fixture_tau(), "paper_qwen3_8b_t1": PAPER_TAU_QWEN3_8B}
    prompt = random_prompt(config.vocab_size, args.prompt_tokens).to(target.device)
    result = measure(target, drafter, prompt, args.new_tokens, taus)
    lm_head = target.get_output_embeddings()
    payload = {
        "what": "batch-1 greedy decoding of a random-init Qwen3-8B-shaped target loaded 4-bit NF4 (bitsandbytes, "
                f"compute {dtype}) with vs without a random DSpark drafter of the published 8B drafter's shape "
                "(same dtype, shares the target's embedding and LM head); timing only (see benchmarks/big_common.py)",
        "environment": environment(), "tiny": args.tiny,
        "bitsandbytes": __import__("bitsandbytes").__version__,
        "target": {**checkpoint, "quantization": quantization.to_dict(), "loaded": loaded,
                   "lm_head_dtype": str(lm_head.weight.dtype), "drafter_shares_lm_head":
                   drafter.lm_head.weight is lm_head.weight},
        "drafter_own_gib": own_bytes(drafter, target) / 2**30,
        "result": result,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(describe(result))
    print(f"target {loaded['target_footprint_gib']:.2f} GiB (bf16 would be {checkpoint['bytes'] / 2**30:.2f} GiB), "
          f"drafter's own weights {payload['drafter_own_gib']:.2f} GiB -> {out}")


if __name__ == "__main__":
    main()
