"""CLI building blocks: `add_train_parser(subparsers)` (`train ...`) and `add_data_parser(subparsers)`
(`data generate ...`). Each sets a `func` default taking the parsed `argparse.Namespace`; `dspark-hf` (cli.py) and
`python -m dspark_hf.training` wire them in."""

from __future__ import annotations

import argparse
import json


def _load_target(path: str, dtype: str = "auto"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype == "auto":
        torch_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return target, tokenizer


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def detect_format(path: str) -> str:
    """'text' for NUL-separated text files or JSONL with "text" records, else 'chat'."""
    from .data import read_jsonl

    if not path.endswith((".jsonl", ".jsonl.xz", ".jsonl.gz")):
        return "text"
    first = next(read_jsonl(path), {})
    return "text" if "text" in first and "conversations" not in first and "messages" not in first else "chat"


def build_config(args: argparse.Namespace):
    from .config import TrainingConfig, preset

    if args.preset:
        config = preset(args.preset)
    elif args.config:
        config = TrainingConfig.from_json(args.config)
    else:
        config = TrainingConfig()
    if args.preset and args.config:
        with open(args.config) as f:
            config = config.replace(**json.load(f))
    changes = {}
    for flag, field_name in (("mode", "mode"), ("max_steps", "max_steps"), ("epochs", "num_epochs"),
                             ("batch_size", "batch_size"), ("micro_batch_size", "micro_batch_size"),
                             ("lr", "learning_rate"), ("num_anchors", "num_anchors"), ("max_length", "max_length"),
                             ("attn", "attn_implementation"), ("precision", "precision"),
                             ("feature_cache", "feature_cache"), ("seed", "seed")):
        value = getattr(args, flag, None)
        if value is not None:
            changes[field_name] = value
    if args.compile:
        changes["compile"] = True
    for item in args.set or []:
        key, _, value = item.partition("=")
        changes[key] = _parse_value(value)
    if args.mode == "dflash" and "markov_rank" not in changes:
        changes.update(markov_rank=0, ce_alpha=1.0, l1_alpha=0.0, confidence_alpha=0.0)
    return config.replace(**changes) if changes else config


def load_dataset(path: str, tokenizer, config, data_format: str = "auto", chat_template: str | None = None,
                 max_tokens: int | None = None):
    from .data import chat_dataset, read_documents, read_jsonl, text_dataset

    data_format = detect_format(path) if data_format == "auto" else data_format
    if data_format == "text":
        return text_dataset(tokenizer, read_documents(path), config.max_length, max_tokens=max_tokens)
    return chat_dataset(tokenizer, read_jsonl(path), config.max_length, chat_template=chat_template)


def eval_prompts_from(dataset, count: int, prompt_tokens: int = 128):
    """Held-out prompts: the part before the first loss token (chat) or the first `prompt_tokens` tokens (text)."""
    prompts = []
    for i in range(min(count, len(dataset))):
        ids, mask = dataset[i]
        first = int(mask.nonzero()[0]) if mask.any() else len(ids)
        cut = first if 0 < first < len(ids) else min(prompt_tokens, len(ids) - 1)
        prompts.append(ids[:cut])
    return prompts


def run_train(args: argparse.Namespace) -> int:
    from .trainer import train_drafter

    config = build_config(args)
    target, tokenizer = _load_target(args.target, args.target_dtype)
    dataset = load_dataset(args.data, tokenizer, config, args.data_format, args.chat_template, args.max_tokens)
    prompts = []
    if args.eval_holdout:
        dataset, held = dataset.split(args.eval_holdout)
        prompts = eval_prompts_from(held, args.eval_holdout)
    summary = train_drafter(target, tokenizer, dataset, config, args.output, eval_prompts=prompts,
                            resume=not args.no_resume)
    print(json.dumps(summary, indent=2))
    return 0


def run_data_generate(args: argparse.Namespace) -> int:
    from .data import self_distill

    target, tokenizer = _load_target(args.target, args.target_dtype)
    import torch

    if torch.cuda.is_available():
        target = target.to("cuda")
    written = self_distill(target, tokenizer, args.input, args.output, batch_size=args.batch_size,
                           max_new_tokens=args.max_new_tokens, chat_template=args.chat_template, limit=args.limit,
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    print(f"wrote {written} records to {args.output}")
    return 0


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    from .config import PRESETS

    parser = subparsers.add_parser("train", help="train a DSpark/DFlash drafter for a target (online features)",
                                   description="Train a drafter. Under `accelerate launch --num_processes N` the same "
                                   "command runs data-parallel on N GPUs.")
    parser.add_argument("--target", required=True, help="target model (HF id or folder)")
    parser.add_argument("--data", required=True, help="JSONL conversations/prompts, JSONL {'text'}, or a text file "
                        "with NUL-separated documents (.xz/.gz read transparently)")
    parser.add_argument("--output", required=True, help="output folder (drafter, metrics, checkpoints)")
    parser.add_argument("--config", help="JSON file of TrainingConfig fields (applied over --preset)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named recipe")
    parser.add_argument("--mode", choices=["dspark", "dflash"])
    parser.add_argument("--data-format", choices=["auto", "chat", "text"], default="auto")
    parser.add_argument("--chat-template", help="'chatml' or a Jinja template for tokenizers without one")
    parser.add_argument("--max-tokens", type=int, help="text mode: use at most this many tokens")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--epochs", type=float)
    parser.add_argument("--batch-size", type=int, help="global batch in sequences")
    parser.add_argument("--micro-batch-size", type=int, help="sequences per process and forward")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--num-anchors", type=int)
    parser.add_argument("--max-length", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--attn", choices=["auto", "flex_attention", "sdpa", "eager"])
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--target-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--feature-cache", help="folder for on-disk target features (reused when complete)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the loss")
    parser.add_argument("--eval-holdout", type=int, default=0, help="hold out N samples as real-τ prompts")
    parser.add_argument("--no-resume", action="store_true", help="ignore checkpoints in --output")
    parser.add_argument("--set", action="append", metavar="FIELD=VALUE", help="any TrainingConfig field (JSON value)")
    parser.set_defaults(func=run_train)
    return parser


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("data", help="training-data tools")
    data_sub = parser.add_subparsers(dest="data_command", required=True)
    generate = data_sub.add_parser("generate", help="target self-distillation: regenerate assistant turns",
                                   description="Regenerates every assistant turn with the target (its recommended "
                                   "sampling parameters unless overridden); resumable: appends and skips done ids.")
    generate.add_argument("--target", required=True)
    generate.add_argument("--input", required=True, help="JSONL with 'conversations'/'messages'/'prompt'")
    generate.add_argument("--output", required=True, help="JSONL to append to")
    generate.add_argument("--batch-size", type=int, default=16)
    generate.add_argument("--max-new-tokens", type=int, default=1024)
    generate.add_argument("--temperature", type=float)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--min-p", type=float)
    generate.add_argument("--limit", type=int, help="only the first N records")
    generate.add_argument("--chat-template", help="'chatml' or a Jinja template for tokenizers without one")
    generate.add_argument("--target-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    generate.set_defaults(func=run_data_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_hf.training", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_train_parser(subparsers)
    add_data_parser(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)
