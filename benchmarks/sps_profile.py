"""Profile target forward steps/s vs total batch tokens (the hardware-aware scheduler's SPS curve) on this device.

    python benchmarks/sps_profile.py --model code50m|qwen3-4b-shape [--context 1024] [--dtype bfloat16]

`code50m` is the 50M code fixture; `qwen3-4b-shape` is a random-init model with Qwen3-4B's shapes (timing only).
Writes benchmarks/results/sps_<model>_<device>.json (an SPSTable file, loadable with SPSTable.load) and appends the
environment and command.
"""

from __future__ import annotations

import argparse

import torch
from common import RESULTS, environment, load_target

from dspark_hf.scheduling import SPSTable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["code50m", "qwen3-4b-shape"], required=True)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048")
    args = parser.parse_args()
    model = load_target(args.model, getattr(torch, args.dtype), args.device).eval()
    table = SPSTable.profile(model, batch_tokens=[int(b) for b in args.batch_tokens.split(",")],
                             context_length=args.context, model_name=args.model, num_sequences=1, repeats=7)
    table.meta["environment"] = environment()
    path = RESULTS / f"sps_{args.model}_{torch.device(args.device).type}.json"
    table.save(path)
    print(path, SPSTable.load(path).to_dict())


if __name__ == "__main__":
    main()
