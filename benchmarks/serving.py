"""Serving benchmark: DSparkEngine tokens/s vs concurrency for no speculation, fixed γ, a static threshold and the
hardware-aware scheduler, plus the distribution of per-request verify lengths.

    # on the H200 (bf16 target + published drafter; profiles the SPS table first unless --sps-table is given)
    PYTHONPATH=src python benchmarks/serving.py --target Qwen/Qwen3-8B \
        --drafter deepseek-ai/dspark_qwen3_8b_block7 --out benchmarks/results/serving_h200.json
    # CPU smoke test with tiny random models (writes to a temp dir; never commit its output)
    PYTHONPATH=src python benchmarks/serving.py --smoke

Protocol (closed loop): for each concurrency c and policy, 2·c requests (at least --min-requests) with the same
prompts and `max_tokens` are queued at once into an engine with `max_batch_size=c`, so c requests decode at a time
and waiting ones join as others finish. One warm-up run per policy precedes the timed runs. tokens/s = generated
tokens / wall-clock seconds. The JSON records every (policy, c) cell, the verify-length histogram, τ, and the two
summary ratios: `scheduler_vs_best_static_min_ratio` (min over c of hardware-aware / best of the static policies)
and `scheduler_vs_nospec_min_ratio` (min over c of hardware-aware / no speculation).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, humaneval_prompts  # noqa: E402

import dspark_hf  # noqa: E402
from dspark_hf.scheduling import SPSTable  # noqa: E402
from dspark_hf.serving import DSparkEngine  # noqa: E402

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STATIC = ("fixed_1", "fixed_3", "fixed_7", "static_threshold")


def policies(threshold: float, gamma_max: int) -> dict[str, dict]:
    table = {"no_spec": dict(policy="none")}
    for gamma in (1, 3, 7):
        if gamma <= gamma_max:
            table[f"fixed_{gamma}"] = dict(policy="fixed", gamma=gamma)
    table["static_threshold"] = dict(policy="static_threshold", threshold=threshold)
    table["hardware_aware"] = dict(policy="hardware_aware")
    return table


def tiny_models():
    """A float32 random Qwen3 target and a random DSpark drafter for it (CPU smoke test only)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, num_hidden_layers=4, eos_token_id=2, **common)).eval()
    drafter = dspark_hf.DSparkDraftModel(dspark_hf.DSparkConfig(
        vocab_size=96, num_hidden_layers=2, target_layer_ids=[0, 2], num_target_layers=4, mask_token_id=3,
        block_size=8, markov_rank=8, enable_confidence_head=True, **common)).eval()
    return target, drafter, None


def load_models(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, device_map=args.device).eval()
    drafter = dspark_hf.DSparkDraftModel.from_pretrained(args.drafter, dtype=dtype).to(args.device).eval()
    return target, drafter, tokenizer


def prompt_ids(args, tokenizer, count: int) -> list[list[int]]:
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(4, 96, (int(n),), generator=generator).tolist()
                for n in torch.randint(4, 16, (count,), generator=generator)]
    texts = humaneval_prompts(count)
    return [tokenizer.apply_chat_template([{"role": "user", "content": "Complete this function:\n" + text}],
                                          add_generation_prompt=True, tokenize=True, enable_thinking=False)["input_ids"]
            for text in texts]


def run_cell(target, drafter, tokenizer, prompts, concurrency: int, setting: dict, args, sps_table) -> dict:
    kwargs = dict(setting)
    if kwargs.get("policy") == "hardware_aware":
        kwargs["sps_table"] = sps_table
    engine = DSparkEngine(target, drafter if kwargs.get("policy") != "none" else None, tokenizer,
                          max_batch_size=concurrency, seed=0, **kwargs)
    count = max(2 * concurrency, args.min_requests)
    sampling = dict(max_tokens=args.max_new_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
    handles = [engine.add_request(prompts[i % len(prompts)], **sampling) for i in range(count)]
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.run()
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(h.tokens) for h in handles)
    verify_lengths = Counter(n for entry in engine.round_log for n in entry["verify"])
    accepted = [n for entry in engine.round_log for n in entry["accepted"]]
    return dict(
        concurrency=concurrency, requests=count, generated_tokens=tokens, seconds=seconds,
        tokens_per_second=tokens / seconds, rounds=len(engine.round_log),
        tau=(sum(accepted) + len(accepted)) / max(1, len(accepted)),
        verify_length_histogram={str(k): v for k, v in sorted(verify_lengths.items())},
        mean_batch=sum(e["batch"] for e in engine.round_log) / max(1, len(engine.round_log)),
    )


def summarize(cells: dict[str, list[dict]]) -> dict:
    by = {name: {c["concurrency"]: c["tokens_per_second"] for c in rows} for name, rows in cells.items()}
    levels = sorted(by.get("hardware_aware", {}))
    vs_static, vs_nospec = [], []
    for level in levels:
        hw = by["hardware_aware"][level]
        static = [by[name][level] for name in STATIC if name in by and level in by[name]]
        if static:
            vs_static.append(hw / max(static))
        if level in by.get("no_spec", {}):
            vs_nospec.append(hw / by["no_spec"][level])
    return dict(
        scheduler_vs_best_static_min_ratio=min(vs_static) if vs_static else None,
        scheduler_vs_nospec_min_ratio=min(vs_nospec) if vs_nospec else None,
        scheduler_vs_best_static_by_concurrency=dict(zip(map(str, levels), vs_static)),
        scheduler_vs_nospec_by_concurrency=dict(zip(map(str, levels), vs_nospec)),
    )


def plot(cells: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in cells.items():
        left.plot([r["concurrency"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o", label=name)
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrency")
    left.set_ylabel("generated tokens / s")
    left.legend()
    left.set_title("throughput vs concurrency")
    for row in cells.get("hardware_aware", []):
        hist = {int(k): v for k, v in row["verify_length_histogram"].items()}
        total = sum(hist.values()) or 1
        keys = sorted(hist)
        right.plot(keys, [hist[k] / total for k in keys], marker=".", label=f"c={row['concurrency']}")
    right.set_xlabel("verify length l_r (drafted tokens verified)")
    right.set_ylabel("fraction of request-rounds")
    right.set_title("hardware-aware: per-request verify lengths")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="Qwen/Qwen3-8B")
    parser.add_argument("--drafter", default="deepseek-ai/dspark_qwen3_8b_block7")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="every request generates exactly max tokens")
    parser.add_argument("--threshold", type=float, default=0.5, help="static-threshold policy's confidence threshold")
    parser.add_argument("--sps-table", help="SPSTable JSON for the hardware-aware policy (default: profile now)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/serving_h200.json; temp dir for --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny random models on CPU, tiny concurrency")
    args = parser.parse_args()

    if args.smoke:
        args.concurrency = [c for c in args.concurrency if c <= 4] or [1]
        args.max_new_tokens, args.min_requests, args.ignore_eos = min(args.max_new_tokens, 8), 2, True
        target, drafter, tokenizer = tiny_models()
        sps_table = SPSTable.profile(target, batch_tokens=(1, 4, 16, 64), context_length=16, repeats=2, progress=False)
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="serving-smoke-")) / "serving_smoke.json"
    else:
        target, drafter, tokenizer = load_models(args)
        sps_table = (SPSTable.load(args.sps_table) if args.sps_table else
                     SPSTable.profile(target, batch_tokens=(1, 8, 32, 64, 128, 256, 512, 1024, 2048), progress=False))
        out = Path(args.out) if args.out else RESULTS / "serving_h200.json"
    prompts = prompt_ids(args, tokenizer, 64)
    gamma_max = drafter.config.num_draft_slots

    cells: dict[str, list[dict]] = {}
    with torch.inference_mode():
        for name, setting in policies(args.threshold, gamma_max).items():
            run_cell(target, drafter, tokenizer, prompts, 1, setting, args, sps_table)  # warm-up
            for concurrency in args.concurrency:
                cell = run_cell(target, drafter, tokenizer, prompts, concurrency, setting, args, sps_table)
                cells.setdefault(name, []).append(cell)
                print(f"{name:>16} c={concurrency:<4} {cell['tokens_per_second']:9.1f} tok/s  tau={cell['tau']:.2f}",
                      flush=True)
    payload = dict(
        benchmark="serving", smoke=args.smoke, environment=environment(),
        settings=dict(target=None if args.smoke else args.target, drafter=None if args.smoke else args.drafter,
                      dtype="float32" if args.smoke else args.dtype, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, ignore_eos=args.ignore_eos, threshold=args.threshold,
                      concurrency=args.concurrency, prompts="random ids" if args.smoke else "HumanEval (chat)",
                      sps_table=sps_table.to_dict()),
        results=cells, **summarize(cells),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    plot(cells, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    print({k: payload[k] for k in ("scheduler_vs_best_static_min_ratio", "scheduler_vs_nospec_min_ratio")})


if __name__ == "__main__":
    main()
