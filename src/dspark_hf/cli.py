"""`dspark-hf` command line: thin wrappers over the library."""

from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load_pair(target_id: str, drafter_id: str, dtype: str, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import DSparkDraftModel

    tokenizer = AutoTokenizer.from_pretrained(target_id)
    target = AutoModelForCausalLM.from_pretrained(target_id, dtype=DTYPES[dtype]).to(device).eval()
    drafter = DSparkDraftModel.from_pretrained(drafter_id, dtype=DTYPES[dtype]).to(device).eval()
    return tokenizer, target, drafter


def _print_comparison(tokenizer, comparison) -> None:
    from .evaluation import Comparison

    assert isinstance(comparison, Comparison)
    text = tokenizer.decode(comparison.dspark_ids[0, comparison.prompt_length:], skip_special_tokens=True)
    stats = comparison.stats
    print(text)
    print("-" * 60)
    print(f"plain  : {comparison.plain_tokens_per_second:8.1f} tokens/s")
    print(f"DSpark : {comparison.dspark_tokens_per_second:8.1f} tokens/s  (x{comparison.speedup:.2f})")
    print(f"tau (accepted length per round, bonus included): {stats.tau:.2f} over {stats.rounds} rounds")
    rates = ", ".join(f"{r:.2f}" for r in stats.acceptance_by_position())
    print(f"accept_rate@k: [{rates}]")
    print(f"identical to plain decoding: {comparison.identical}")


def cmd_generate(args: argparse.Namespace) -> int:
    from .evaluation import compare_generation, encode_prompt

    tokenizer, target, drafter = _load_pair(args.target, args.drafter, args.dtype, args.device)
    input_ids = encode_prompt(tokenizer, args.prompt, args.chat).to(args.device)
    sampling = dict(do_sample=args.temperature > 0, max_new_tokens=args.max_new_tokens)
    if args.temperature > 0:
        sampling.update(temperature=args.temperature, top_p=args.top_p)
    torch.manual_seed(args.seed)
    compare_generation(target, drafter, input_ids, **{**sampling, "max_new_tokens": 4})  # warm-up
    torch.manual_seed(args.seed)
    _print_comparison(tokenizer, compare_generation(target, drafter, input_ids, **sampling))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import json

    from .evaluation import calibrate_drafter, encode_prompt, load_prompts

    tokenizer, target, drafter = _load_pair(args.target, args.drafter, args.dtype, args.device)
    prompts = [encode_prompt(tokenizer, p, args.chat) for p in load_prompts(args.prompts, args.num_prompts)]
    metrics = calibrate_drafter(target, drafter, prompts, args.temperature, args.output,
                                max_new_tokens=args.max_new_tokens, holdout_fraction=args.holdout, seed=args.seed)
    summary = {"sts_temperatures": metrics["sts_temperatures"], "held_out_mean_ece_raw": metrics["raw"]["mean_ece"],
               "held_out_mean_ece_sts": metrics["sts"]["mean_ece"]}
    print(json.dumps(summary, indent=2))
    print(f"calibrated drafter, metrics.json and reliability.png written to {args.output}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from . import DSparkDraftModel
    from .evaluation import load_task, plot_report, run_evaluation

    tokenizer, target, drafter = _load_pair(args.target, args.drafter, args.dtype, args.device)
    drafters = {"dspark": drafter}
    for spec in args.compare or []:
        name, _, path = spec.partition("=")
        drafters[name] = DSparkDraftModel.from_pretrained(path, dtype=DTYPES[args.dtype]).to(args.device).eval()
    for spec in args.assistant or []:
        name, _, path = spec.partition("=")
        drafters[name] = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).to(args.device).eval()
    tasks = {name: load_task(name, args.data_dir, args.num_samples, args.seed) for name in args.tasks.split(",")}
    report = run_evaluation(
        target, tokenizer, drafters, tasks, temperatures=[float(t) for t in args.temperature.split(",")],
        max_new_tokens=args.max_new_tokens, chat=args.chat, seed=args.seed, baseline=not args.no_baseline,
        threshold_sweep=[float(t) for t in args.threshold_sweep.split(",")] if args.threshold_sweep else [],
        gamma=args.gamma,
    )
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    report["settings"] = {key: value for key, value in vars(args).items() if key != "func"}
    (output / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_report(report, output)
    print(json.dumps(report["tau"], indent=2))
    print(f"results.json and plots written to {output}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """--target/--drafter plus where and in which dtype to run them."""
    parser.add_argument("--target", required=required, help="target model: Hub id or local folder")
    parser.add_argument("--drafter", required=required, help="DSpark drafter: Hub id or local folder")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", action="store_true", help="wrap prompts in the target's chat template")


def _add_decoding_arguments(parser: argparse.ArgumentParser, prompt: str | None, max_new_tokens: int) -> None:
    parser.add_argument("--prompt", required=prompt is None, default=prompt)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark-hf", description="DSpark speculative decoding for transformers.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="decode one prompt with DSpark and with plain decoding")
    _add_model_arguments(generate)
    _add_decoding_arguments(generate, prompt=None, max_new_tokens=128)
    generate.set_defaults(func=cmd_generate)

    calibrate = commands.add_parser("calibrate", help="fit Sequential Temperature Scaling from real rollouts")
    _add_model_arguments(calibrate)
    calibrate.add_argument("--prompts", required=True, help="JSONL (prompt/question/turns/messages) or text file")
    calibrate.add_argument("--temperature", type=float, required=True, help="the serving temperature (0 = greedy)")
    calibrate.add_argument("--output", required=True, help="folder for drafter/, metrics.json, reliability.png")
    calibrate.add_argument("--num-prompts", type=int, default=None)
    calibrate.add_argument("--max-new-tokens", type=int, default=128)
    calibrate.add_argument("--holdout", type=float, default=0.3, help="fraction of prompts held out for scoring")
    calibrate.set_defaults(func=cmd_calibrate)

    evaluation = commands.add_parser("eval", help="τ, acceptance per position, calibration and speed per task")
    _add_model_arguments(evaluation)
    evaluation.add_argument("--tasks", default="gsm8k,humaneval,mtbench", help="comma-separated task names")
    evaluation.add_argument("--data-dir", help="local task JSONL folder (e.g. ../shared/data); else the Hub")
    evaluation.add_argument("--num-samples", type=int, help="cap on prompts per task (default: DeepSpec's counts)")
    evaluation.add_argument("--temperature", default="1.0", help="comma-separated, e.g. 0,1.0")
    evaluation.add_argument("--max-new-tokens", type=int, default=256)
    evaluation.add_argument("--output", required=True)
    evaluation.add_argument("--compare", action="append", metavar="NAME=PATH",
                            help="another drafter to evaluate alongside (e.g. dflash=PATH); repeatable")
    evaluation.add_argument("--assistant", action="append", metavar="NAME=PATH",
                            help="a classic small assistant LM as a baseline (transformers' assisted generation)")
    evaluation.add_argument("--gamma", type=int, help="ablation: verify at most this many drafts per round")
    evaluation.add_argument("--threshold-sweep", help="comma-separated static thresholds to sweep")
    evaluation.add_argument("--no-baseline", action="store_true", help="skip plain decoding (no speedup)")
    evaluation.set_defaults(func=cmd_eval)

    demo = commands.add_parser("demo", help="offline side-by-side of plain decoding and DSpark")
    _add_model_arguments(demo, required=False)
    _add_decoding_arguments(demo, prompt="def quicksort(items):", max_new_tokens=48)
    demo.set_defaults(func=cmd_demo)

    from .checkpoints.commands import add_convert_parser

    add_convert_parser(commands)
    try:
        from .training.commands import add_data_parser, add_train_parser
    except ImportError:
        pass
    else:
        add_train_parser(commands)
        add_data_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
