"""Profile target forward steps/s vs total batch tokens (the hardware-aware scheduler's SPS curve) on this device.

    python benchmarks/sps_profile.py --model code50m|qwen3-4b-shape [--context 1024] [--dtype bfloat16]

`code50m` is the 50M code fixture; `qwen3-4b-shape` is a random-init model with Qwen3-4B's shapes (timing only).
Writes benchmarks/results/sps_<model>_<device>.json (an SPSTable file, loadable with SPSTable.load) and appends the
environment and command.
"""

from __future__ import annotations

import argparse

import torch
from common import RESULTS, environment, materialize_fixture
from transformers import AutoModelForCausalLM, Qwen3Config

from dspark_hf.scheduling import SPSTable

QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True)


def load(name: str, dtype: torch.dtype, device: str):
    if name == "code50m":
        return AutoModelForCausalLM.from_pretrained(materialize_fixture("code-llama-50m"), dtype=dtype).to(device)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_4B), dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["code50m", "qwen3-4b-shape"], required=True)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048")
    args = parser.parse_args()
    model = load(args.model, getattr(torch, args.dtype), args.device).eval()
    table = SPSTable.profile(model, batch_tokens=[int(b) for b in args.batch_tokens.split(",")],
                             context_length=args.context, model_name=args.model, num_sequences=1, repeats=7)
    table.meta["environment"] = environment()
    path = RESULTS / f"sps_{args.model}_{torch.device(args.device).type}.json"
    table.save(path)
    print(path, SPSTable.load(path).to_dict())


if __name__ == "__main__":
    main()
