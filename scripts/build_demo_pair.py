#!/usr/bin/env python3
"""Build the embedded demo pair `demo_models/{target,drafter}` that `dspark-hf demo` and the Space load offline.

The target is a small Llama code model (d=192, 8 layers, 3 heads / 1 KV head, FFN 768, tied embeddings, SmolLM2
tokenizer: ~13.9 M parameters, ~28 MB in fp16) trained from scratch on real Python; the drafter is its DSpark drafter
(2 layers, Markov rank 32, confidence head, block 7; ~8 MB in fp16, most of it the Markov head's vocab x rank
tables; the embedding and LM head come from the target)
trained with `dspark_hf.training`. Three phases:

    # 1. CPU machine (where the corpus's source wheels are): corpus + tokenizer into carry/demo_pair/ (~15 MB)
    python scripts/build_demo_pair.py prepare --work carry/demo_pair
    # 2. GPU machine: train the target, then the drafter; writes OUT/target, OUT/drafter, OUT/build_report.json
    python scripts/build_demo_pair.py train --work carry/demo_pair --out $OUT/demo_models --target-budget-s 240
    # 3. back here: copy OUT/demo_models to ./demo_models, then measure τ and speed on CPU (float32)
    python scripts/build_demo_pair.py check --models demo_models

`--smoke` shrinks every phase to seconds on a CPU (a few steps, a few documents) to test the script itself; the
models it makes are not worth keeping. The corpus keeps its upstream licences: it is used here to train and not
redistributed (the trained weights are committed, the text is not).
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT / "src"))

TARGET_CONFIG = dict(vocab_size=49152, hidden_size=192, intermediate_size=768, num_hidden_layers=8,
                     num_attention_heads=3, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                     rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=0, pad_token_id=0,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# The drafter: the 50M fixture's recipe (same tokenizer, same 8-layer depth), read from layers 1, 3, 5.
DRAFTER_PRESET = "code50m-dspark"
DRAFTER_OVERRIDES = dict(target_layer_ids=[1, 3, 5], intermediate_size=768, num_draft_layers=2, mask_token_id=3,
                         save_dtype="float16")
MAX_TARGET_MB = 32


def versions() -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


# ---------------------------------------------------------------------------------------------- 1. prepare (CPU)
def prepare(args) -> None:
    """Real Python corpus (`../shared/tools/build_code_corpus.py`) and the SmolLM2 tokenizer, xz-compressed."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    fixture = SHARED / "fixtures" / "code-llama-50m"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fixture / name, work / name)
    raw = work / "corpus.txt"
    max_mb = 2 if args.smoke else args.corpus_mb
    subprocess.run([sys.executable, str(SHARED / "tools" / "build_code_corpus.py"), str(raw), "--max-mb", str(max_mb),
                    "--holdout-mb", "0.3" if args.smoke else "1", "--seed", str(args.seed)], check=True)
    for path in (raw, work / "corpus.holdout.txt"):
        with open(path, "rb") as src, lzma.open(str(path) + ".xz", "wb", preset=6) as dst:
            shutil.copyfileobj(src, dst)
        path.unlink()
    total = sum(f.stat().st_size for f in work.iterdir()) / 2**20
    print(f"prepared {work}: {total:.1f} MiB (a GPU run carries at most 64 MiB with the code)")


# ---------------------------------------------------------------------------------------------- 2. train (GPU)
def load_tokenizer(work: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(work))


def tokenized_chunks(tokenizer, path: Path, length: int, max_tokens: int | None = None) -> torch.Tensor:
    from dspark_hf.training import read_documents, text_dataset

    dataset = text_dataset(tokenizer, read_documents(str(path)), length, max_tokens=max_tokens)
    return torch.stack(dataset.input_ids)


def train_target(args, tokenizer, chunks: torch.Tensor, out: Path) -> dict:
    """Next-token pretraining from scratch: AdamW, warm-up + cosine, bf16 autocast on GPU, a wall-clock budget."""
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    config = LlamaConfig(**TARGET_CONFIG)
    model = LlamaForCausalLM(config).to(device)
    model.config.use_cache = False
    step_fn = torch.compile(model) if args.compile and device == "cuda" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.target_lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device == "cuda")
    batch, steps = args.target_batch, args.target_steps
    warmup = max(1, steps // 25)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    generator = torch.Generator().manual_seed(args.seed)
    started, history, step = time.time(), [], 0
    model.train()
    while step < steps and time.time() - started < args.target_budget_s:
        rows = torch.randint(0, chunks.shape[0], (batch,), generator=generator)
        ids = chunks[rows].to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = step_fn(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % args.logging_steps == 0 or step == 1:
            history.append({"step": step, "loss": float(loss.detach()), "seconds": time.time() - started})
            print(json.dumps(history[-1]), flush=True)
    model.config.use_cache = True
    model = model.to(torch.float16).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    size_mb = (out / "model.safetensors").stat().st_size / 2**20
    if size_mb > MAX_TARGET_MB:
        raise SystemExit(f"target is {size_mb:.1f} MiB, over the {MAX_TARGET_MB} MiB the repository can hold")
    tokens_seen = step * batch * chunks.shape[1]
    return {"steps": step, "seconds": time.time() - started, "tokens_seen": tokens_seen, "size_mib": size_mb,
            "parameters": sum(p.numel() for p in model.parameters()), "history": history}


def heldout_loss(model_dir: Path, chunks: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        losses = [float(model(input_ids=c[None].to(device), labels=c[None].to(device)).loss) for c in chunks[:16]]
    return sum(losses) / len(losses)


def train_drafter_phase(args, tokenizer, chunks: torch.Tensor, target_dir: Path, out: Path) -> dict:
    """The DSpark drafter for the new target, with the library's own trainer (`dspark_hf.training`)."""
    try:
        from dspark_hf.training import TokenizedDataset, preset, train_drafter
    except ImportError:  # pragma: no cover - the training API predates this script; kept for old checkouts
        raise SystemExit("dspark_hf.training is missing: TODO train the drafter once the training API exists")
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(device).eval()
    ones = torch.ones(chunks.shape[1], dtype=torch.uint8)
    dataset = TokenizedDataset(list(chunks.unbind(0)), [ones] * chunks.shape[0])
    overrides = dict(DRAFTER_OVERRIDES, max_length=int(chunks.shape[1]), max_steps=args.drafter_steps,
                     compile=args.compile and device == "cuda", logging_steps=args.logging_steps)
    if args.smoke:
        overrides.update(batch_size=2, micro_batch_size=2, num_anchors=16, eval_num_prompts=1, eval_max_new_tokens=8)
    config = preset(DRAFTER_PRESET, **overrides)
    started = time.time()
    summary = train_drafter(target, tokenizer, dataset, config, str(out), resume=False, progress=False)
    for leftover in ("checkpoints", "checkpoint", "training_state"):
        shutil.rmtree(out / leftover, ignore_errors=True)
    return {"seconds": time.time() - started, "config": config.to_dict(),
            "summary": {k: v for k, v in summary.items() if k != "history"} if isinstance(summary, dict) else summary}


def train(args) -> None:
    work, out = Path(args.work), Path(args.out)
    tokenizer = load_tokenizer(work)
    length = 128 if args.smoke else args.seq_len
    max_tokens = 64 * length if args.smoke else None
    started = time.time()
    chunks = tokenized_chunks(tokenizer, work / "corpus.txt.xz", length, max_tokens)
    holdout = tokenized_chunks(tokenizer, work / "corpus.holdout.txt.xz", length, 16 * length)
    report = {"command": " ".join(sys.argv), "versions": versions(), "chunks": list(chunks.shape),
              "tokenize_s": time.time() - started}
    print(json.dumps(report), flush=True)
    report["target"] = train_target(args, tokenizer, chunks, out / "target")
    report["target"]["heldout_loss"] = heldout_loss(out / "target", holdout)
    print(json.dumps({k: v for k, v in report["target"].items() if k != "history"}), flush=True)
    drafter_chunks = chunks[: max(2, args.drafter_chunks)] if args.drafter_chunks else chunks
    report["drafter"] = train_drafter_phase(args, tokenizer, drafter_chunks, out / "target", out / "drafter")
    report["total_s"] = time.time() - started
    (out / "build_report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"demo pair written to {out}")


# ---------------------------------------------------------------------------------------------- 3. check (CPU)
def check(args) -> None:
    """τ and wall-clock speed on CPU (float32) on held-out prompts; writes benchmarks/results/demo_pair_cpu.json."""
    import dspark_hf  # noqa: F401
    from dspark_hf.demo import load_demo_pair
    from dspark_hf.evaluation import compare_generation

    pair = load_demo_pair(demo_models=args.models)
    prompts = ["def quicksort(items):\n", "import os\n\n\ndef read_config(path):\n",
               "class Stack:\n    def __init__(self):\n", "def fibonacci(n):\n    \"\"\"Return the n-th number.\"\"\"\n"]
    results = []
    for temperature in (0.0, 1.0):
        for prompt in prompts[: 1 if args.smoke else None]:
            ids = pair.encode(prompt)
            sampling = {"do_sample": temperature > 0, "max_new_tokens": args.max_new_tokens}
            if temperature > 0:
                sampling["temperature"] = temperature
            compare_generation(pair.target, pair.drafter, ids, **{**sampling, "max_new_tokens": 4})
            result = compare_generation(pair.target, pair.drafter, ids, **sampling)
            results.append({"prompt": prompt, "temperature": temperature, "tau": result.stats.tau,
                            "speedup": result.speedup, "plain_tok_s": result.plain_tokens_per_second,
                            "dspark_tok_s": result.dspark_tokens_per_second, "identical": result.identical,
                            "accept_rate_at_k": result.stats.acceptance_by_position()})
            print(json.dumps(results[-1]), flush=True)
    sizes = {part: sum(f.stat().st_size for f in (Path(args.models) / part).iterdir()) / 2**20
             for part in ("target", "drafter")}
    report = {"command": " ".join(sys.argv), "versions": versions(), "machine": platform.machine(),
              "threads": torch.get_num_threads(), "sizes_mib": sizes, "runs": results}
    path = Path(args.models) / "check.smoke.json" if args.smoke else ROOT / "benchmarks" / "results" / "demo_pair_cpu.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["prepare", "train", "check"])
    parser.add_argument("--work", default=str(ROOT / "carry" / "demo_pair"), help="corpus + tokenizer folder")
    parser.add_argument("--out", default=str(ROOT / "demo_models"), help="train: where target/ and drafter/ go")
    parser.add_argument("--models", default=str(ROOT / "demo_models"), help="check: the pair to measure")
    parser.add_argument("--smoke", action="store_true", help="seconds on a CPU: tests the script, not the models")
    parser.add_argument("--corpus-mb", type=float, default=75)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--target-batch", type=int, default=64)
    parser.add_argument("--target-steps", type=int, default=4000)
    parser.add_argument("--target-budget-s", type=float, default=240)
    parser.add_argument("--target-lr", type=float, default=2e-3)
    parser.add_argument("--drafter-steps", type=int, default=3000)
    parser.add_argument("--drafter-chunks", type=int, default=0, help="0: all corpus chunks")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--compile", action="store_true", help="torch.compile on GPU")
    parser.add_argument("--logging-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.smoke:
        args.target_steps, args.drafter_steps, args.target_batch, args.logging_steps = 3, 2, 2, 1
        args.max_new_tokens = 8
    {"prepare": prepare, "train": train, "check": check}[args.phase](args)


if __name__ == "__main__":
    main()
