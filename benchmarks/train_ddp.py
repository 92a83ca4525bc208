"""Data-parallel drafter training: 1 process vs `accelerate launch --num_processes 2`, same global batch.

    python benchmarks/train_ddp.py run --target T --tokens tokens.safetensors --steps 150 --out /tmp/ddp/1gpu
    accelerate launch --num_processes 2 benchmarks/train_ddp.py run ... --out /tmp/ddp/2gpu
    python benchmarks/train_ddp.py merge /tmp/ddp/1gpu /tmp/ddp/2gpu --out train_ddp.json

The global batch (16 sequences × 1024 tokens, 256 anchors each) is 2 micro-batches of 8 on one GPU (gradient
accumulation) and 1 micro-batch of 8 per GPU on two. Sample order and anchors depend only on (seed, epoch, index) and
the loss is normalised by the global weight sum, so both compute the same gradient: the loss curves should agree up
to floating-point reduction order.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def run(args) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_hf.training import TokenizedDataset, preset
    from dspark_hf.training.trainer import DrafterTrainer

    torch.backends.cuda.matmul.allow_tf32 = True
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    chunks = load_file(args.tokens)["input_ids"].long()
    ones = torch.ones(chunks.shape[1], dtype=torch.uint8)
    dataset = TokenizedDataset(list(chunks.unbind(0)), [ones] * chunks.shape[0])
    config = preset("code50m-dspark", max_steps=args.steps, compile=args.compile, attn_implementation=args.attn,
                    logging_steps=args.steps, **json.loads(args.overrides))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    trainer = DrafterTrainer(target, tokenizer, dataset, config, args.out, resume=False, progress=False)
    # Throughput after warm-up (compilation): time the second half of the run.
    half = args.steps // 2
    started = time.perf_counter()
    tokens = 0
    for step in range(args.steps):
        if step == half:
            sync()
            started, tokens = time.perf_counter(), 0
        tokens += trainer.train_step()["tokens"]
    sync()
    elapsed = time.perf_counter() - started
    if trainer.accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ddp_result.json"), "w") as f:
            json.dump({"num_processes": trainer.world, "steps": args.steps, "global_batch": config.batch_size,
                       "micro_batch_size": config.micro_batch_size, "step_losses": trainer.step_losses,
                       "steady_tokens_per_s": tokens / elapsed, "steady_steps": args.steps - half,
                       "attn_implementation": args.attn, "compile": args.compile}, f)


def merge(args) -> None:
    import transformers

    results = {}
    for path in args.runs:
        with open(os.path.join(path, "ddp_result.json")) as f:
            r = json.load(f)
        results[f"{r['num_processes']}gpu"] = r
    one, two = results["1gpu"]["step_losses"], results["2gpu"]["step_losses"]
    diffs = [abs(a - b) / max(abs(a), 1e-9) for a, b in zip(one, two)]
    summary = {
        "max_relative_loss_difference": max(diffs),
        "mean_relative_loss_difference": sum(diffs) / len(diffs),
        "relative_loss_difference_first_10_steps": max(diffs[:10]),
        "loss_first_last": {k: [v["step_losses"][0], v["step_losses"][-1]] for k, v in results.items()},
        "tokens_per_s": {k: v["steady_tokens_per_s"] for k, v in results.items()},
        "speedup_2gpu": results["2gpu"]["steady_tokens_per_s"] / results["1gpu"]["steady_tokens_per_s"],
    }
    out = {"summary": summary, "runs": results,
           "machine": "nvidia-h200-x2 (2x H200, one host)", "command": args.command,
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version()}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary, indent=1))


def run_all(args) -> None:
    """1-process run, 2-process run (accelerate launch), merge -- skipped when `--deadline` (epoch seconds) is near."""
    import subprocess

    common = ["--target", args.target, "--tokens", args.tokens, "--steps", str(args.steps), "--attn", args.attn]
    common += ["--compile"] if args.compile else []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    launches = {
        "1": [sys.executable, __file__, "run", *common, "--out", os.path.join(args.work, "1gpu")],
        "2": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "bf16", "--dynamo_backend", "no", __file__, "run", *common,
              "--out", os.path.join(args.work, "2gpu")],
    }
    for name, cmd in launches.items():
        remaining = args.deadline - time.time() if args.deadline else 1e9
        if remaining < 60:
            print(f"skipping the {name}-process run: {remaining:.0f} s left", flush=True)
            return
        subprocess.run(cmd, env=env, check=True, timeout=max(30, remaining - 20))
    args.runs = [os.path.join(args.work, "1gpu"), os.path.join(args.work, "2gpu")]
    args.command = " ".join(launches["2"][2:])
    merge(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--target", required=True)
    r.add_argument("--tokens", required=True)
    r.add_argument("--steps", type=int, default=150)
    r.add_argument("--out", required=True)
    r.add_argument("--attn", default="flex_attention")
    r.add_argument("--compile", action="store_true")
    r.add_argument("--overrides", default="{}", help="JSON TrainingConfig overrides (dry runs)")
    m = sub.add_parser("merge")
    m.add_argument("runs", nargs="+")
    m.add_argument("--out", required=True)
    m.add_argument("--command", default="")
    a = sub.add_parser("all")
    a.add_argument("--target", required=True)
    a.add_argument("--tokens", required=True)
    a.add_argument("--steps", type=int, default=120)
    a.add_argument("--attn", default="flex_attention")
    a.add_argument("--compile", action="store_true")
    a.add_argument("--work", default="/tmp/ddp")
    a.add_argument("--out", required=True)
    a.add_argument("--deadline", type=float, default=0.0)
    args = parser.parse_args()
    {"run": run, "merge": merge, "all": run_all}[args.cmd](args)


if __name__ == "__main__":
    main()
