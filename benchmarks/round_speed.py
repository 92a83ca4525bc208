"""Batch-1 round speed: plain decoding and DSpark, eager and on the static-cache loop, against the weight-read floor.

    # on the H200, one model per run; each run merges its entry into benchmarks/results/round_speed_h200.json (+ .png)
    PYTHONPATH=src python benchmarks/round_speed.py --model code50m          # the 50M fixture + its drafter: real τ
    PYTHONPATH=src python benchmarks/round_speed.py --model qwen3-4b-shape   # random init: timing only
    PYTHONPATH=src python benchmarks/round_speed.py --model qwen3-8b-shape   # (also qwen3-0.6b-shape)
    # CPU smoke run (tiny random models, temp dir; never commit its output)
    PYTHONPATH=src python benchmarks/round_speed.py --model smoke --device cpu

Methods, all greedy, batch 1, one prompt, `--new-tokens` tokens, each timed after an identical warm-up run:
- `plain_eager`: `target.generate()`;
- `plain_static_compile`: `target.generate(cache_implementation="static")`, which transformers compiles;
- `dspark_generate`: `target.generate(assistant_model=drafter)`, eager, every draft verified;
- `dspark_static`: `dspark_hf.generation.static_generate(compile=False)`;
- `dspark_static_compiled`: the same with `compile=True` (`torch.compile(mode="reduce-overhead")`: CUDA graphs).

Every method runs under `dspark_hf.decoding_attention()`, so all use the same attention kernels. The weight-read
floor is the target's weight bytes over the device's measured copy bandwidth (2 × bytes / seconds of a 1 GiB
`copy_`). Random-weight targets accept almost nothing, so their DSpark rows measure the cost of a round
(τ ≈ 1). Summary keys: `round_time_over_floor_4b` / `_8b` (the compiled static loop's ms per round over the floor),
and for the fixture `tau` and `speedup_over_fast_plain` (`dspark_static_compiled` tokens/s over the faster of
`plain_eager` and `plain_static_compile`). Not measured here yet: batch 64, prompt lookup, transformers' assisted
generation with the 10M assistant, and the DFlash path. `matched_plain`: the share of `plain_eager`'s tokens a method
reproduced before its first difference (bf16 kernels round differently). The fixture's prompt is the first HumanEval
prompt whose plain greedy continuation has no eos within `--new-tokens` (`static_generate` runs with eos off).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QWEN3_4B, REPO, RESULTS, environment, humaneval_prompts, load_target, synchronize  # noqa: E402

import dspark_hf  # noqa: E402
from dspark_hf.generation import static_generate  # noqa: E402

SHAPES = {
    "qwen3-0.6b-shape": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b-shape": QWEN3_4B,
    "qwen3-8b-shape": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "smoke": dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8),
}


def models(name: str, dtype: torch.dtype, device: str, new_tokens: int = 128):
    """(target, drafter, prompt [1, L]) for the fixture or a random shape (random 5-layer DSpark drafter)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    if name == "code50m":
        target = load_target(name, dtype, device).eval()
        drafter = dspark_hf.DSparkDraftModel.from_pretrained(REPO / "drafters" / "code50m-dspark", dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(target.config._name_or_path)
        prompt = first_prompt_without_eos(target, tokenizer, humaneval_prompts(40), new_tokens)
        return target, drafter.to(device).eval(), prompt
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[name], max_position_embeddings=4096, eos_token_id=None)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        drafter = dspark_hf.DSparkDraftModel(dspark_hf.DSparkConfig.from_target_config(
            config, mask_token_id=config.vocab_size - 1, num_hidden_layers=1 if name == "smoke" else 5, block_size=7,
            markov_rank=16 if name == "smoke" else 256, enable_confidence_head=True)).to(dtype).eval()
    prompt = torch.randint(4, config.vocab_size - 1, (1, 16 if name == "smoke" else 128),
                           generator=torch.Generator().manual_seed(0))
    return target, drafter, prompt.to(device)


def first_prompt_without_eos(target, tokenizer, texts: list[str], new_tokens: int) -> torch.Tensor:
    """The first prompt whose plain greedy continuation has no eos within `new_tokens`: every method then decodes
    the same text (`static_generate` runs with eos off, while `min_new_tokens` would make generate() suppress an
    eos that plain decoding wants; on the fixture's first HumanEval prompt that is the very first token)."""
    eos = target.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else eos or [])
    for text in texts:
        prompt = tokenizer(text, return_tensors="pt")["input_ids"].to(target.device)
        with torch.no_grad():
            continuation = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[0, prompt.shape[1]:]
        if continuation.numel() == new_tokens and not eos & set(continuation.tolist()):
            return prompt
    raise RuntimeError(f"every prompt's greedy continuation reaches eos within {new_tokens} tokens")


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write counted), median of 5; None on the CPU."""
    if device.type != "cuda":
        return None
    source = torch.empty(2**30, dtype=torch.uint8, device=device)
    sink = torch.empty_like(source)
    times = []
    for _ in range(6):
        synchronize(device)
        started = time.perf_counter()
        sink.copy_(source)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return 2 * source.numel() / sorted(times[1:])[2]


def run(method, device: torch.device) -> tuple[torch.Tensor, float]:
    with torch.no_grad(), dspark_hf.decoding_attention():
        method()  # warm-up: the same shapes (and, for compiled methods, the compilation)
        synchronize(device)
        started = time.perf_counter()
        output = method()
        synchronize(device)
    return output, time.perf_counter() - started


def measure(target, drafter, prompt, new_tokens: int) -> dict:
    device = target.device
    fixed = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    methods = {
        "plain_eager": lambda: target.generate(prompt, **fixed),
        "plain_static_compile": lambda: target.generate(prompt, cache_implementation="static", **fixed),
        "dspark_generate": lambda: target.generate(prompt, assistant_model=drafter, **fixed),
        "dspark_static": lambda: static_generate(target, drafter, prompt, new_tokens, eos_token_id=[]),
        "dspark_static_compiled": lambda: static_generate(target, drafter, prompt, new_tokens, eos_token_id=[],
                                                          compile=device.type == "cuda"),
    }
    rows, outputs = {}, {}
    for name, method in methods.items():
        output, seconds = run(method, device)
        generated = output.shape[1] - prompt.shape[1]
        row = dict(tokens_per_second=generated / seconds, ms_per_token=1e3 * seconds / generated)
        if name.startswith("dspark"):
            stats = drafter.generation_stats
            row.update(tau=stats.tau, rounds=stats.rounds, ms_per_round=1e3 * seconds / max(1, stats.rounds))
        rows[name], outputs[name] = row, output[0, prompt.shape[1]:]
        print(f"{name:>24} {row['tokens_per_second']:8.1f} tok/s"
              + (f"  tau {row['tau']:.2f}  {row['ms_per_round']:.1f} ms/round" if "tau" in row else ""), flush=True)
    reference = outputs["plain_eager"]
    for name, tokens in outputs.items():  # bf16 kernels may round differently; float32 is tested exactly
        n = min(tokens.numel(), reference.numel())
        differ = (tokens[:n] != reference[:n]).nonzero()
        rows[name]["matched_plain"] = (int(differ[0, 0]) if differ.numel() else n) / max(1, reference.numel())
    return rows


def summarize(entries: dict) -> dict:
    summary = {}
    for label, name in (("4b", "qwen3-4b-shape"), ("8b", "qwen3-8b-shape")):
        entry = entries.get(name)
        if entry and entry.get("floor_ms"):
            summary[f"round_time_over_floor_{label}"] = (entry["methods"]["dspark_static_compiled"]["ms_per_round"]
                                                          / entry["floor_ms"])
    fixture = entries.get("code50m")
    if fixture:
        methods = fixture["methods"]
        fast_plain = max(methods[name]["tokens_per_second"] for name in ("plain_eager", "plain_static_compile"))
        summary["tau"] = methods["dspark_static_compiled"]["tau"]
        summary["speedup_over_fast_plain"] = methods["dspark_static_compiled"]["tokens_per_second"] / fast_plain
    return summary


def plot(entries: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(entries)
    methods = list(next(iter(entries.values()))["methods"])
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(methods)
    for index, method in enumerate(methods):
        ax.bar([i + index * width for i in range(len(names))],
               [entries[n]["methods"][method]["tokens_per_second"] for n in names], width, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("generated tokens / s (batch 1)")
    ax.set_yscale("log")
    ax.set_title("Round speed (random shapes: timing only, τ ≈ 1)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["code50m", *SHAPES], required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", help="JSON path (default benchmarks/results/round_speed_h200.json; smoke: temp dir)")
    args = parser.parse_args()
    dtype = torch.float32 if args.model == "smoke" else getattr(torch, args.dtype)
    if args.model == "smoke":
        args.new_tokens = min(args.new_tokens, 16)
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="round-speed-")) / "round_speed_smoke.json"
                                           if args.model == "smoke" else RESULTS / "round_speed_h200.json")
    target, drafter, prompt = models(args.model, dtype, args.device, args.new_tokens)
    bandwidth = copy_bandwidth(target.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    entry = dict(environment=environment(), dtype=str(dtype).removeprefix("torch."), prompt_tokens=prompt.shape[1],
                 new_tokens=args.new_tokens, gamma=drafter.config.num_draft_slots, weight_bytes=weight_bytes,
                 copy_bandwidth_bytes_per_s=bandwidth,
                 floor_ms=1e3 * weight_bytes / bandwidth if bandwidth else None,
                 acceptance="real" if args.model == "code50m" else "random weights: timing only (tau ~ 1)",
                 methods=measure(target, drafter, prompt, args.new_tokens))
    payload = json.loads(out.read_text()) if out.exists() else dict(benchmark="round_speed", models={})
    payload["models"][args.model] = entry
    payload.update(summarize(payload["models"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    plot(payload["models"], out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
