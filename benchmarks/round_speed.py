"""Round speed at batch 1 and 64: plain decoding, transformers' speculative paths and DSpark vs the weight-read floor.

    # on the H200, one model per run (batch 1 and 64 in the same run); each run merges its entry into
    # benchmarks/results/round_speed_h200.json (+ .png)
    PYTHONPATH=src python benchmarks/round_speed.py --model code50m --batch 1,64          # the 50M fixture: real τ
    PYTHONPATH=src python benchmarks/round_speed.py --model qwen3-4b-shape --batch 1,64   # random init: timing only
    PYTHONPATH=src python benchmarks/round_speed.py --model qwen3-8b-shape --batch 1,64   # (also qwen3-0.6b-shape)
    # CPU smoke run (tiny random models, temp dir; never commit its output), and the fixture on the CPU
    PYTHONPATH=src python benchmarks/round_speed.py --model smoke --device cpu --batch 1,4
    PYTHONPATH=src python benchmarks/round_speed.py --model code50m --device cpu --dtype float32 --new-tokens 16 \
        --batch 1,4 --threads 1 --out /tmp/round_speed_code50m_cpu.json

Methods at batch 1, all greedy, one prompt, `--new-tokens` tokens, each timed after an identical warm-up run:
- `plain_eager`: `target.generate()`;
- `plain_static_compile`: `target.generate(cache_implementation="static")`, which transformers compiles (CUDA only);
- `dspark_generate`: `target.generate(assistant_model=drafter)`, eager, every draft verified;
- `plain_static`: `dspark_hf.generation.static_generate(target, None, ...)`: plain decoding on our static-cache loop
  (no host sync per token: eos is off);
- `plain_static_compiled`: the same with `compile=True` (one CUDA graph per token, captured directly;
  `DSPARK_CUDA_GRAPHS=trees`: reduce-overhead's graph trees): our fast plain decoding;
- `dspark_static`: `static_generate(target, drafter, ...)`, eager;
- `dspark_static_compiled`: the same with `compile=True`: drafter, Markov loop, target forward and acceptance of a
  round in one CUDA graph, one host sync per round;
- `prompt_lookup`: `target.generate(prompt_lookup_num_tokens=10)` (transformers' prompt lookup, n-gram size 2);
- `assisted_10m` (`code50m` only): `target.generate(assistant_model=assistant)` with the fixture's classic 10M
  assistant (`code-llama-10m-assistant`, same dtype and device), transformers' defaults for it (5.17: 20 draft
  tokens, constant schedule, confidence threshold 0.4, adapted during a call only when scikit-learn is installed;
  the row records what was set and whether scikit-learn was there).

`prompt_lookup` and `assisted_10m` report `tau` and `rounds` too: transformers does not expose acceptance, so
`rounds` is the number of target forwards in the timed call (a forward pre-hook; the prefill is the first round, as
in transformers' loop) and `tau` = generated tokens / rounds.

Methods at batch B > 1 (`--batch 1,64`; stored as the model entry's `batch_64`, etc.): B greedy requests of exactly
`--new-tokens` tokens (random shapes: the prompt repeated B times; `code50m`: B different HumanEval prompts whose
plain greedy continuation has no eos, left-padded, repeated when fewer exist):
- `plain_eager`, `plain_static_compile`: batched `target.generate()` (left padding, attention mask), as above;
- `dspark_engine`: `dspark_hf.serving.DSparkEngine(target, drafter, max_batch_size=B, policy="fixed")`, all B
  requests queued at once (`ignore_eos=True`), every draft verified; `tau` and `rounds` from its round log;
- `engine_no_spec`: the same engine with `policy="none"` and no drafter (our plain batched decoding);
- `plain_static`, `plain_static_compiled`, `dspark_static`, `dspark_static_compiled`:
  `dspark_hf.generation.static_generate_batch` (static caches with a write position per row; eos off), eager and
  with `compile=True` on CUDA (one CUDA graph per round, one host read per round); `tau` and `rounds` from its
  per-row statistics;
- `dspark_static_refill_compiled`: the same, compiled, over the B prompts twice with `max_batch_size=B`: a row that
  has its tokens takes the next prompt (continuous batching), so rows do not wait for the batch's slowest one; `tau`
  from its per-request statistics (no `rounds` / `ms_per_round`: a row serves several requests).

Not measured, with the reason also in each entry's `not_measured` (method -> reason):
- at batch > 1: transformers' assisted generation and prompt lookup (its `_assisted_decoding` raises for batch > 1);
  batched `generate(assistant_model=drafter)` is not timed separately (dspark_hf routes it to the decoding core the
  engine runs, `SpeculativeRows`);
- `dflash_native`, transformers' DFlash path (`speculation_type="dflash"`, `DFlashTokenCandidateGenerator`),
  with our `drafters/code50m-dflash`. That generator calls `assistant_model(noise_embeds=, context_hidden_states=,
  position_ids=<context + block>, attention_mask=, past_key_values=DFlashCache)`, keeps the block's K/V in the cache
  until it crops them, reads taps as `hidden_states[i]` (i = 0 is the embedding output) and takes
  `last_hidden_state[:, 1:]` through the target's head (mask slot j drafts anchor + j, z-lab's layout); in
  transformers 5.17 only `MuseGlimmerAssistantModel` has that interface. Checked on the CPU with the fixture: (a) with
  dspark_hf's hook installed (importing dspark_hf installs it), `generate(assistant_model=<DSparkDraftModel>,
  speculation_type="dflash")` is refused (one drafting method per call); (b) with the hook bypassed, the drafter
  fails in its forward (`DSparkDraftModel.forward` takes `input_ids` / `target_hidden_states`:
  `embed_tokens(None)` raises a TypeError); (c) no dspark_hf export loads as a DFlash assistant: `to="zlab"`
  refuses this drafter (`block_layout="deepspec"`: slot i drafts anchor + i + 1), and `to="deepspec"` writes
  `Qwen3DSparkModel` / `model_type "qwen3"`, which transformers loads as a plain `Qwen3Model` (fc and hidden_norm
  dropped, `input_ids` forward). Making it run would need a new converter to MuseGlimmerAssistant's modules (tap ids
  shifted by one) and a drafter trained in z-lab's block layout (ours is DeepSpec's), so it is left out.

Every method runs under `dspark_hf.decoding_attention()`, so all use the same attention kernels. The weight-read
floor is the target's weight bytes over the device's measured copy bandwidth (2 × bytes / seconds of a 1 GiB
`copy_`). Random-weight targets accept almost nothing, so their DSpark rows measure the cost of a round
(τ ≈ 1). `static_generate` rows also give the steady state: `ms_per_steady_round` (DSpark: the rounds after the
first one, from its round statistics, and `ms_outside_steady_rounds`: the rest of the call, prefill included) and
`prefill_ms` / `ms_per_steady_token` (plain: the prefill timed alone, one new token, and the rest per token).
Compiled, `static_generate` prefills a prompt of up to 512 tokens as graphed 64-token chunks; `--eager-prefill`
runs it as one eager forward instead (before 2026-12-07). `--inductor NAME=VALUE ...` sets `torch._inductor.config`
values for the run (recorded as `inductor_settings`), and the environment records `DSPARK_SKINNY_LINEAR`, the few-rows
GEMM's switch: both for comparisons. Summary keys (batch 1):
`round_time_over_floor_4b` / `_8b` (`dspark_static_compiled`'s ms per steady round over the floor;
`plain_step_over_floor_*` the same for `plain_static_compiled`'s ms per steady token;
`round_time_over_round_floor_*` the round over `round_floor_ms`, the target's and the drafter's weight bytes read
once: what the round itself must read, for reference beside the goal's measure), and for the fixture `tau`
and `speedup_over_fast_plain` (`dspark_static_compiled` tokens/s over the fastest of `plain_eager`,
`plain_static_compile` and `plain_static_compiled`, named in `fast_plain_method`), with `speedup_goal` = 0.8 τ.
A method that raises is kept as `{"error": ...}` and left out of the summary. `matched_plain`: the share of
`plain_eager`'s tokens a method reproduced before its first difference (bf16 kernels round differently; batch > 1: the
mean over rows, and `matched_plain_min` the worst row). The fixture's batch-1 prompt is the first HumanEval prompt
whose plain greedy continuation has no eos within `--new-tokens` (`static_generate` runs with eos off, and
`min_new_tokens` would make generate() suppress an eos that plain decoding wants).
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
from common import (QWEN3_4B, REPO, RESULTS, environment, humaneval_prompts, load_target,  # noqa: E402
                    materialize_fixture)

import dspark_hf  # noqa: E402
from dspark_hf.devices import synchronize  # noqa: E402
from dspark_hf.generation import static_generate, static_generate_batch, static_loop  # noqa: E402
from dspark_hf.serving import DSparkEngine  # noqa: E402

SHAPES = {
    "qwen3-0.6b-shape": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b-shape": QWEN3_4B,
    "qwen3-8b-shape": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "smoke": dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8),
}
HUMANEVAL_SIZE = 164
PROMPT_LOOKUP_TOKENS = 10

DFLASH_NATIVE = (
    "transformers' DFlash path (speculation_type='dflash') needs an assistant with MuseGlimmerAssistantModel's "
    "interface (noise_embeds / context_hidden_states forward, DFlashCache, taps as hidden_states[i], z-lab block "
    "layout: mask slot j drafts anchor + j). drafters/code50m-dflash is a DSparkDraftModel in DeepSpec's layout: "
    "with dspark_hf's hook the call is refused (one drafting method per call), without it the "
    "drafter's forward raises (embed_tokens(None)); no dspark_hf export loads as such an assistant (to='zlab' refuses "
    "deepspec-layout drafters, to='deepspec' loads as a plain Qwen3Model). See the module docstring.")


def not_measured(name: str, batch: int) -> dict[str, str]:
    """Method -> why it is not in the entry for model `name` at batch size `batch`."""
    if batch == 1:
        skipped = {}
        if name == "code50m":
            skipped["dflash_native"] = DFLASH_NATIVE
        else:
            skipped["assisted_10m"] = "the 10M assistant is the code fixture's (its tokenizer); random shapes have none"
            skipped["dflash_native"] = "no DFlash drafter for a random shape (and see code50m's reason)"
        return skipped
    hf_batch_1 = "batch 1 only: transformers' _assisted_decoding raises for batch_size > 1"
    return {"prompt_lookup": hf_batch_1,
            "dspark_generate": "not timed separately: dspark_hf routes batched generate(assistant_model=drafter) to "
                               "SpeculativeRows, the decoding core dspark_engine runs (with "
                               "cache_implementation='static': to static_generate_batch, as dspark_static_compiled)",
            "dflash_native": "batch 1 only (transformers' assisted loop); see the batch-1 entry",
            "assisted_10m": hf_batch_1 if name == "code50m" else "no assistant for a random shape"}


def shape_config(name: str):
    """The random target's `Qwen3Config` for shape `name` (no eos: every method decodes the same length)."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**SHAPES[name], "max_position_embeddings": 4096, "eos_token_id": None})


def models(name: str, dtype: torch.dtype, device: str, new_tokens: int = 128):
    """(target, drafter, prompt [1, L]) for the fixture or a random shape (random 5-layer DSpark drafter)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "code50m":
        target = load_target(name, dtype, device).eval()
        drafter = dspark_hf.DSparkDraftModel.from_pretrained(REPO / "drafters" / "code50m-dspark", dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(target.config._name_or_path)
        prompt = torch.tensor([prompts_without_eos(target, tokenizer, humaneval_prompts(40), new_tokens, 1)[0]],
                              device=device)
        return target, drafter.to(device).eval(), prompt
    torch.manual_seed(0)
    config = shape_config(name)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        drafter = dspark_hf.DSparkDraftModel(dspark_hf.DSparkConfig.from_target_config(
            config, mask_token_id=config.vocab_size - 1, num_hidden_layers=1 if name == "smoke" else 5, block_size=7,
            markov_rank=16 if name == "smoke" else 256, enable_confidence_head=True)).to(dtype).eval()
    prompt = torch.randint(4, config.vocab_size - 1, (1, 16 if name == "smoke" else 128),
                           generator=torch.Generator().manual_seed(0))
    return target, drafter, prompt.to(device)


def assistant_model(name: str, dtype: torch.dtype, device: str | torch.device):
    """The code fixture's classic 10M assistant (as benchmarks/eval_code50m.py loads it); None for other models."""
    if name != "code50m":
        return None
    from transformers import AutoModelForCausalLM

    path = materialize_fixture("code-llama-10m-assistant")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def eos_ids(target) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set([eos] if isinstance(eos, int) else eos or [])


def pad_id(target) -> int:
    pad = target.generation_config.pad_token_id
    return pad if isinstance(pad, int) else min(eos_ids(target), default=0)


def left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `input_ids` [B, L] and `attention_mask` [B, L] (0 over the padding)."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], device=device)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=device)
    return ids, mask


def prompts_without_eos(target, tokenizer, texts: list[str], new_tokens: int, count: int) -> list[list[int]]:
    """`count` prompts (token ids) whose plain greedy continuation, decoded in left-padded batches of `count`, has
    no eos within `new_tokens`, in `texts` order; repeated cyclically when fewer exist (none: RuntimeError). Then
    every method decodes the same text: `static_generate` runs with eos off, while `min_new_tokens` would make
    generate() suppress an eos that plain decoding wants (on the fixture's first HumanEval prompt, the very first
    token)."""
    eos, found = eos_ids(target), []
    for start in range(0, len(texts), count):
        rows = [tokenizer(text)["input_ids"] for text in texts[start:start + count]]
        ids, mask = left_pad(rows, pad_id(target), target.device)
        with torch.no_grad():
            out = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=pad_id(target))[:, ids.shape[1]:]
        found += [row for row, tokens in zip(rows, out.tolist())
                  if len(tokens) == new_tokens and not eos & set(tokens)]
        if len(found) >= count:
            return found[:count]
    if not found:
        raise RuntimeError(f"every prompt's greedy continuation reaches eos within {new_tokens} tokens")
    return [found[i % len(found)] for i in range(count)]


def batch_prompts(name: str, target, prompt: torch.Tensor, batch: int, new_tokens: int) -> list[list[int]]:
    """The batch's prompts: random shapes repeat `prompt`; the fixture takes `batch` HumanEval prompts without eos."""
    if name != "code50m":
        return [prompt[0].tolist()] * batch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target.config._name_or_path)
    return prompts_without_eos(target, tokenizer, humaneval_prompts(HUMANEVAL_SIZE), new_tokens, batch)


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


def weight_read_floor(target, drafter, bandwidth: float | None = None) -> dict:
    """The target's weight bytes, the device's copy bandwidth (`bandwidth` where given, else measured: None on the
    CPU) and the time to read the weights once at that bandwidth (`floor_ms`, None without a bandwidth);
    `round_floor_ms` the same for the bytes a DSpark round reads: the target's weights and every weight of the
    drafter's forward (`drafter_weight_bytes`) but its input embedding, of which a round reads a few rows. An LM head
    taken from the target counts again: the draft and the verify each read all of it, one after the other, and it is
    far larger than the L2 cache."""
    bandwidth = bandwidth or copy_bandwidth(target.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    drafter_bytes = sum(p.numel() * p.element_size() for name, p in drafter.named_parameters(remove_duplicate=False)
                        if name.split(".")[0] != "embed_tokens")
    return dict(weight_bytes=weight_bytes, drafter_weight_bytes=drafter_bytes, copy_bandwidth_bytes_per_s=bandwidth,
                floor_ms=1e3 * weight_bytes / bandwidth if bandwidth else None,
                round_floor_ms=1e3 * (weight_bytes + drafter_bytes) / bandwidth if bandwidth else None)


def run(method, device: torch.device, count_forwards_of=None) -> tuple[torch.Tensor, float, int | None]:
    """(output, seconds, forwards): `method` timed after an identical warm-up call; `forwards` counts the calls of
    `count_forwards_of` (a module) in the timed call (None when not asked)."""
    calls = [0]

    def count(*_):
        calls[0] += 1

    with torch.no_grad(), dspark_hf.decoding_attention():
        method()  # warm-up: the same shapes (and, for compiled methods, the compilation)
        synchronize(device)
        handle = count_forwards_of.register_forward_pre_hook(count) if count_forwards_of is not None else None
        try:
            started = time.perf_counter()
            output = method()
            synchronize(device)
            seconds = time.perf_counter() - started
        finally:
            if handle is not None:
                handle.remove()
    return output, seconds, calls[0] if handle is not None else None


def first_difference_share(tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """The share of `reference`'s tokens that `tokens` reproduces before its first difference."""
    n = min(tokens.numel(), reference.numel())
    differ = (tokens[:n] != reference[:n]).nonzero()
    return (int(differ[0, 0]) if differ.numel() else n) / max(1, reference.numel())


def selected(methods: dict, only: set[str] | None) -> dict:
    """The methods named in `only` (all when None) and plain_eager, the reference every row is compared with."""
    if only is None:
        return methods
    unknown = only - set(methods)
    if unknown:
        raise SystemExit(f"--methods: no method {sorted(unknown)} here; there are {sorted(methods)}")
    return {name: method for name, method in methods.items() if name in only or name == "plain_eager"}


def measure(target, drafter, prompt, new_tokens: int, assistant=None, only: set[str] | None = None) -> dict:
    """Batch 1: one row per method (tokens/s, ms per token; τ, rounds and ms per round where known); `only`: the
    methods to run (plain_eager, the reference for `matched_plain`, always runs)."""
    device = target.device
    fixed = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    methods = {
        "plain_eager": lambda: target.generate(prompt, **fixed),
        "plain_static_compile": lambda: target.generate(prompt, cache_implementation="static", **fixed),
        "dspark_generate": lambda: target.generate(prompt, assistant_model=drafter, **fixed),
        "plain_static": lambda: static_generate(target, None, prompt, new_tokens, eos_token_id=[]),
        "plain_static_compiled": lambda: static_generate(target, None, prompt, new_tokens, eos_token_id=[],
                                                         compile=device.type == "cuda"),
        "dspark_static": lambda: static_generate(target, drafter, prompt, new_tokens, eos_token_id=[]),
        "dspark_static_compiled": lambda: static_generate(target, drafter, prompt, new_tokens, eos_token_id=[],
                                                          compile=device.type == "cuda"),
        "prompt_lookup": lambda: target.generate(prompt, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS, **fixed),
    }
    if assistant is not None:
        methods["assisted_10m"] = lambda: target.generate(prompt, assistant_model=assistant, **fixed)
    methods = selected(methods, only)
    counted = {"prompt_lookup", "assisted_10m"}  # transformers' loops: τ from the target's forward count
    rows, outputs = {}, {}
    for name, method in methods.items():
        try:
            output, seconds, forwards = run(method, device, target if name in counted else None)
        except Exception as error:  # noqa: BLE001 - one failing method is recorded, the others still run
            rows[name] = dict(error=f"{type(error).__name__}: {error}"[:2000])
            print(f"{name:>29} FAILED: {rows[name]['error'][:300]}", flush=True)
            continue
        generated = output.shape[1] - prompt.shape[1]
        row = dict(tokens_per_second=generated / seconds, ms_per_token=1e3 * seconds / generated)
        if name.startswith("dspark"):
            stats = drafter.generation_stats
            row.update(tau=stats.tau, rounds=stats.rounds, ms_per_round=1e3 * seconds / max(1, stats.rounds))
            if name.startswith("dspark_static") and stats.rounds > 1:  # the rounds after the first one
                row["ms_per_steady_round"] = 1e3 * sum(stats.verify_seconds[1:]) / (stats.rounds - 1)
                # the prefill, the first round and whatever else the call spent outside the steady rounds
                row["ms_outside_steady_rounds"] = 1e3 * (seconds - sum(stats.verify_seconds[1:]))
        elif name in ("plain_static", "plain_static_compiled"):  # per step after the prefill (timed alone; the
            # same compile setting, so that the loop built for the method is reused, not replaced)
            compiled = name == "plain_static_compiled" and device.type == "cuda"
            _, prefill_seconds, _ = run(lambda: static_generate(target, None, prompt, 1, compile=compiled), device)
            row.update(prefill_ms=1e3 * prefill_seconds,
                       ms_per_steady_token=1e3 * (seconds - prefill_seconds) / max(1, generated - 1))
        elif forwards is not None:
            row.update(tau=generated / max(1, forwards), rounds=forwards,
                       ms_per_round=1e3 * seconds / max(1, forwards), rounds_counted="target forwards")
        if name == "prompt_lookup":
            row["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        if name == "assisted_10m":
            row["assistant"] = assistant_settings(assistant)
        rows[name], outputs[name] = row, output[0, prompt.shape[1]:]
        print(f"{name:>29} {row['tokens_per_second']:8.1f} tok/s"
              + (f"  tau {row['tau']:.2f}  {row['ms_per_round']:.1f} ms/round" if "tau" in row else ""), flush=True)
    reference = outputs["plain_eager"]
    for name, tokens in outputs.items():  # bf16 kernels may round differently; float32 is tested exactly
        rows[name]["matched_plain"] = first_difference_share(tokens, reference)
    return rows


def assistant_settings(assistant) -> dict:
    """What the assistant's generation config sets for transformers' assisted loop (None: transformers' default)."""
    import importlib.util

    config = assistant.generation_config
    return dict(parameters=sum(p.numel() for p in assistant.parameters()),
                num_assistant_tokens=config.num_assistant_tokens,
                num_assistant_tokens_schedule=config.num_assistant_tokens_schedule,
                assistant_confidence_threshold=config.assistant_confidence_threshold,
                sklearn_installed=importlib.util.find_spec("sklearn") is not None)


def measure_batch(target, drafter, prompts: list[list[int]], new_tokens: int, only: set[str] | None = None) -> dict:
    """Batch B = len(prompts) > 1: plain batched generate() (eager, static + compile) and our engine with and
    without speculation, every request exactly `new_tokens` greedy tokens (`only` as for `measure`)."""
    device, batch = target.device, len(prompts)
    pad = pad_id(target)
    ids, mask = left_pad(prompts, pad, device)
    fixed = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                 pad_token_id=pad)

    def engine_method(engine: DSparkEngine):
        def call() -> torch.Tensor:
            engine.round_log.clear()
            handles = [engine.add_request(prompt, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
                       for prompt in prompts]
            engine.run()
            return torch.tensor([handle.result().token_ids for handle in handles], device=device)
        return engine, call

    engines = {
        "dspark_engine": engine_method(DSparkEngine(target, drafter, max_batch_size=batch, policy="fixed", seed=0)),
        "engine_no_spec": engine_method(DSparkEngine(target, None, max_batch_size=batch, policy="none", seed=0)),
    }

    def static_batch(model, compile: bool, repeat: int = 1):
        """`static_generate_batch` over the prompts `repeat` times, B rows at once (later ones refill rows)."""
        return lambda: torch.tensor(static_generate_batch(target, model, ids.repeat(repeat, 1), mask.repeat(repeat, 1),
                                                          new_tokens, eos_token_id=[], max_batch_size=batch,
                                                          compile=compile and device.type == "cuda"), device=device)

    methods = {
        "plain_eager": lambda: target.generate(ids, **fixed)[:, ids.shape[1]:],
        "plain_static_compile": lambda: target.generate(ids, cache_implementation="static", **fixed)[:, ids.shape[1]:],
        **{name: call for name, (_, call) in engines.items()},
        "plain_static": static_batch(None, False),
        "plain_static_compiled": static_batch(None, True),
        "dspark_static": static_batch(drafter, False),
        "dspark_static_compiled": static_batch(drafter, True),
        "dspark_static_refill_compiled": static_batch(drafter, True, repeat=2),
    }
    methods = selected(methods, only)
    rows, outputs = {}, {}
    for name, method in methods.items():
        output, seconds, _ = run(method, device)
        generated = output.numel()
        row = dict(tokens_per_second=generated / seconds, ms_per_token=1e3 * seconds / generated,
                   generated_tokens=generated)
        if name in engines:
            log = engines[name][0].round_log
            accepted = [n for entry in log for n in entry["accepted"]]
            row.update(tau=(sum(accepted) + len(accepted)) / max(1, len(accepted)), rounds=len(log),
                       ms_per_round=1e3 * seconds / max(1, len(log)))
        elif name.startswith("dspark_static"):
            stats = drafter.generation_stats
            row.update(tau=stats.tau)
            if "refill" not in name:  # (refilled rows serve several requests: no per-round count per request)
                row.update(rounds=stats.rounds, ms_per_round=1e3 * seconds / max(1, stats.rounds))
        rows[name], outputs[name] = row, output
        print(f"{name:>29} {row['tokens_per_second']:8.1f} tok/s" + (f"  tau {row['tau']:.2f}" if "tau" in row else "")
              + (f"  {row['ms_per_round']:.1f} ms/round" if "ms_per_round" in row else ""), flush=True)
    reference = outputs["plain_eager"]
    for name, tokens in outputs.items():  # (the refill method's rows are the prompts twice)
        shares = [first_difference_share(row, reference[index % batch]) for index, row in enumerate(tokens)]
        rows[name].update(matched_plain=sum(shares) / len(shares), matched_plain_min=min(shares))
    return rows


def summarize(entries: dict) -> dict:
    summary = {}
    for label, name in (("4b", "qwen3-4b-shape"), ("8b", "qwen3-8b-shape")):
        entry = entries.get(name)
        if entry and entry.get("floor_ms") and "methods" in entry:
            methods = {name: row for name, row in entry["methods"].items() if "error" not in row}
            if "dspark_static_compiled" not in methods:
                continue
            round_ms = methods["dspark_static_compiled"]
            steady_round_ms = round_ms.get("ms_per_steady_round", round_ms["ms_per_round"])
            summary[f"round_time_over_floor_{label}"] = steady_round_ms / entry["floor_ms"]
            if entry.get("round_floor_ms"):  # (not the goal's measure: the same round over its own bytes)
                summary[f"round_time_over_round_floor_{label}"] = steady_round_ms / entry["round_floor_ms"]
            if "plain_static_compiled" in methods:
                step_ms = methods["plain_static_compiled"]
                summary[f"plain_step_over_floor_{label}"] = step_ms.get("ms_per_steady_token",
                                                                        step_ms["ms_per_token"]) / entry["floor_ms"]
    fixture = entries.get("code50m")
    if fixture and "dspark_static_compiled" in fixture.get("methods", {}):
        methods = {name: row for name, row in fixture["methods"].items() if "error" not in row}
        fast_plain = max((name for name in ("plain_eager", "plain_static_compile", "plain_static_compiled")
                          if name in methods), key=lambda name: methods[name]["tokens_per_second"])
        summary["tau"] = methods["dspark_static_compiled"]["tau"]
        summary["fast_plain_method"] = fast_plain
        summary["speedup_over_fast_plain"] = (methods["dspark_static_compiled"]["tokens_per_second"]
                                              / methods[fast_plain]["tokens_per_second"])
        summary["speedup_goal"] = 0.8 * summary["tau"]
    return summary


def plot(entries: dict, path: Path) -> None:
    """One panel per batch size: generated tokens/s per model and method (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def tables(entry: dict) -> dict[str, dict]:
        found = {"batch 1": entry["methods"]} if "methods" in entry else {}
        found.update({key.replace("_", " "): value["methods"] for key, value in entry.items()
                      if key.startswith("batch_") and isinstance(value, dict) and "methods" in value})
        return found

    panels = sorted({label for entry in entries.values() for label in tables(entry)},
                    key=lambda label: int(label.split()[1]))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 4.5 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        names = [name for name in entries if panel in tables(entries[name])]
        methods = list(dict.fromkeys(m for name in names for m in tables(entries[name])[panel]))
        width = 0.8 / len(methods)
        for index, method in enumerate(methods):
            ax.bar([i + index * width for i in range(len(names))],
                   [tables(entries[n])[panel].get(method, {}).get("tokens_per_second", float("nan")) for n in names],
                   width, label=method)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
        ax.set_ylabel(f"generated tokens / s ({panel})")
        ax.set_yscale("log")
        ax.set_title(f"Round speed, {panel} (random shapes: timing only, τ ≈ 1)")
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def batch_sizes(text: str) -> list[int]:
    sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["code50m", *SHAPES], required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=batch_sizes, default=[1],
                        help="comma-separated batch sizes, e.g. 1,64 (default 1); batch 1 keeps the entry's "
                             "top-level layout, batch B > 1 goes to entry['batch_B']")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; smoke: 1, its tiny "
                                                     "models only contend for a loaded CPU)")
    parser.add_argument("--methods", nargs="+", help="run only these methods (and plain_eager, the reference); "
                                                      "default: all")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/round_speed_h200.json; smoke: temp dir)")
    parser.add_argument("--eager-prefill", action="store_true",
                        help="static_generate prefills in one eager forward even when compiled (the default runs "
                             "prompts of up to 8 × 64 tokens as graphed 64-token chunks): the before of that change")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="NAME=VALUE",
                        help="torch._inductor.config settings for this run, e.g. combo_kernels=1 (an experiment)")
    args = parser.parse_args()
    import torch._inductor.config as inductor_config

    for setting in args.inductor:
        name, value = setting.split("=", 1)
        setattr(inductor_config, name, type(getattr(inductor_config, name))(int(value)))
    if args.eager_prefill:
        static_loop.MAX_PREFILL_CHUNKS = 0
    if args.threads or args.model == "smoke":
        torch.set_num_threads(args.threads or 1)
    dtype = torch.float32 if args.model == "smoke" else getattr(torch, args.dtype)
    if args.model == "smoke":
        args.new_tokens = min(args.new_tokens, 16)
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="round-speed-")) / "round_speed_smoke.json"
                                           if args.model == "smoke" else RESULTS / "round_speed_h200.json")
    target, drafter, prompt = models(args.model, dtype, args.device, args.new_tokens)
    only = set(args.methods) if args.methods else None
    common = dict(environment=environment(), dtype=str(dtype).removeprefix("torch."), new_tokens=args.new_tokens,
                  gamma=drafter.config.num_draft_slots, **weight_read_floor(target, drafter),
                  static_prefill="eager" if args.eager_prefill else
                  f"chunks of {static_loop.PREFILL_CHUNK} up to {static_loop.MAX_PREFILL_CHUNKS} (compiled)",
                  inductor_settings=args.inductor,
                  acceptance="real" if args.model == "code50m" else "random weights: timing only (tau ~ 1)")
    entry = {}
    for batch in args.batch:
        print(f"--- {args.model}, batch {batch}", flush=True)
        if batch == 1:
            entry.update(common, prompt_tokens=prompt.shape[1], not_measured=not_measured(args.model, 1),
                         methods=measure(target, drafter, prompt, args.new_tokens,
                                         assistant_model(args.model, dtype, target.device), only))
        else:
            prompts = batch_prompts(args.model, target, prompt, batch, args.new_tokens)
            entry[f"batch_{batch}"] = dict(common, batch=batch, prompt_tokens=[len(p) for p in prompts],
                                           distinct_prompts=len({tuple(p) for p in prompts}),
                                           not_measured=not_measured(args.model, batch),
                                           methods=measure_batch(target, drafter, prompts, args.new_tokens, only))
    payload = json.loads(out.read_text()) if out.exists() else dict(benchmark="round_speed", models={})
    if 1 in args.batch:  # a batch-1 run replaces the batch-1 fields; other batch sizes' entries are kept
        previous = payload["models"].get(args.model, {})
        payload["models"][args.model] = {**{k: v for k, v in previous.items() if k.startswith("batch_")}, **entry}
    else:
        payload["models"][args.model] = {**payload["models"].get(args.model, {}), **entry}
    payload.update(summarize(payload["models"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    plot(payload["models"], out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
