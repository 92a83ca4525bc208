"""Helpers for the big-target benchmarks (`quantized.py`, `multi_gpu.py`): an 8B-shaped random target and drafter,
batch-1 timing of plain vs DSpark decoding, and acceptance driven from the target's own recorded output.

Random weights accept almost nothing (τ ≈ 1), so each run reports two things:

- `random_drafter`: the drafter as it is: the per-round cost (draft + verify) and the worst-case speed;
- `projected`: tokens/s = τ / (seconds per round) at reference τ values (the per-round cost barely depends on τ).

(An earlier version also replayed the plain run's tokens as drafts. On the GPU a random bf16 target leaves its own
plain-run path within a few tokens (1-token and (l+1)-token forwards round differently, `matched_plain` ≈ 0.05), so
the replayed drafts were rejected and measured nothing; it was removed, and its rows in quantized_h200.json and
multi_gpu_h200x2.json are kept under `trace_replay_invalid`.)

The random target has its attention and MLP output projections damped (× 0.05, as `tests/tiny_models.py`'s
`make_bigram_like`) so that its greedy path is stable across forward shapes; shapes and cost are unchanged.
"""

from __future__ import annotations

import json
import lzma
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import scratch_dir
from transformers import Qwen3Config, Qwen3ForCausalLM

import dspark_hf

# Paper Table 1 (Qwen3-8B DSpark, T=1, macro over nine tasks; ../shared/reference/deepspec.md §12).
PAPER_TAU_QWEN3_8B = 4.81
RESULTS = Path(__file__).resolve().parent / "results"


def fixture_tau() -> float:
    """τ the 50M code fixture's DSpark drafter measured (greedy, benchmarks/results/eval_code50m.json)."""
    return json.loads((RESULTS / "eval_code50m.json").read_text())["tau"]["dspark"]["t0"]


def qwen3_config(tiny: bool) -> Qwen3Config:
    """Qwen3-8B's shape (36 layers, H 4096, 32/8 heads, FFN 12288, vocab 151936), or a tiny one for CPU smoke runs
    (in_features multiples of 64 for bitsandbytes' CPU 4-bit kernel)."""
    if tiny:
        return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=None)
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
                       eos_token_id=None)


def random_checkpoint(config: Qwen3Config, dtype: torch.dtype, folder: Path) -> dict:
    """Saves a random-init (damped, see the module docstring) target to `folder`; returns its size."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(folder, max_shard_size="4GB")
    info = {"parameters": sum(p.numel() for p in model.parameters()), "dtype": str(dtype).removeprefix("torch.")}
    info["bytes"] = info["parameters"] * model.dtype.itemsize
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return info


def random_drafter(config, dtype: torch.dtype, tiny: bool) -> dspark_hf.DSparkDraftModel:
    """A random DSpark drafter of the published Qwen3-8B drafter's shape (5 layers, block 7, Markov rank 256, taps
    [1, 9, 17, 25, 33]) that takes embed_tokens / lm_head from its target. Built on the CPU: generate() moves it next
    to the target's LM head."""
    torch.manual_seed(1)
    drafter_config = dspark_hf.DSparkConfig.from_target_config(
        config, mask_token_id=config.vocab_size - 1, num_hidden_layers=1 if tiny else 5,
        markov_rank=64 if tiny else 256, block_size=7, enable_confidence_head=True)
    drafter = dspark_hf.DSparkDraftModel(drafter_config).to(dtype).eval()
    drafter.weights_from_target = {"embed_tokens", "lm_head"}
    return drafter


def own_bytes(drafter, target) -> int:
    """Bytes of the drafter's own weights (not counting what it shares with the target)."""
    theirs = {id(p) for p in target.parameters()}
    return sum(p.numel() * p.element_size() for p in drafter.parameters() if id(p) not in theirs)


def gpus() -> list[int]:
    """The GPUs this process uses: all of them, or its own under torchrun (one rank per GPU)."""
    if not torch.cuda.is_available():
        return []
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return [torch.cuda.current_device()]
    return list(range(torch.cuda.device_count()))


def synchronize() -> None:
    for index in gpus():
        torch.cuda.synchronize(index)


def memory() -> dict:
    """Allocated and peak GPU memory per device, in GiB (empty on the CPU)."""
    return {f"cuda:{i}": {"allocated_gib": torch.cuda.memory_allocated(i) / 2**30,
                          "peak_gib": torch.cuda.max_memory_allocated(i) / 2**30} for i in gpus()}


def reset_peaks() -> None:
    for index in gpus():
        torch.cuda.reset_peak_memory_stats(index)


def timed(function):
    synchronize()
    started = time.perf_counter()
    with torch.no_grad():
        output = function()
    synchronize()
    return output, time.perf_counter() - started


def matched(ours: torch.Tensor, plain: torch.Tensor, prompt_length: int) -> float:
    """Fraction of the plain continuation that DSpark reproduced before the first difference."""
    a, b = ours[0, prompt_length:], plain[0, prompt_length:]
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return (int(differ[0, 0]) if differ.numel() else n) / max(1, b.numel())


def measure(target, drafter, prompt: torch.Tensor, new_tokens: int, taus: dict[str, float]) -> dict:
    """Batch-1 greedy plain vs DSpark timing (see the module docstring); γ = the drafter's block, every draft verified."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    warm = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    timed(lambda: target.generate(prompt, **warm))
    timed(lambda: target.generate(prompt, assistant_model=drafter, **warm))
    reset_peaks()
    plain, plain_s = timed(lambda: target.generate(prompt, **kwargs))
    plain_memory = memory()
    reset_peaks()
    ours, ours_s = timed(lambda: target.generate(prompt, assistant_model=drafter, **kwargs))
    stats = drafter.generation_stats
    round_s = (sum(stats.draft_seconds) + sum(stats.verify_seconds)) / max(1, stats.rounds)
    plain_tps = new_tokens / plain_s
    result = {
        "prompt_tokens": prompt.shape[1], "new_tokens": new_tokens, "gamma": drafter.config.num_draft_slots,
        "drafter_device": str(drafter.fc.weight.device), "drafter_own_gib": own_bytes(drafter, target) / 2**30,
        "plain": {"tokens_per_s": plain_tps, "ms_per_token": 1e3 * plain_s / new_tokens, "memory": plain_memory},
        "random_drafter": {
            "tokens_per_s": new_tokens / ours_s, "tau": stats.tau, "rounds": stats.rounds,
            "draft_ms_per_round": 1e3 * sum(stats.draft_seconds) / max(1, stats.rounds),
            "verify_ms_per_round": 1e3 * sum(stats.verify_seconds) / max(1, stats.rounds),
            "round_ms": 1e3 * round_s, "break_even_tau": round_s * plain_tps,
            "matched_plain": matched(ours, plain, prompt.shape[1]), "memory": memory(),
        },
        "projected": {name: {"tau": tau, "tokens_per_s": tau / round_s, "speedup": tau / round_s / plain_tps}
                      for name, tau in taus.items()},
    }
    return result


def prepare_fixture(fixture: Path, dtype: str = "float32") -> Path:
    """A standard HF folder from a fixture folder (as ../shared/fixtures/code-llama-50m, or a carried copy whose files
    may be `.xz`-compressed), through the `materialize.py` beside it."""
    staged = Path(tempfile.mkdtemp(prefix="fixture-")) / fixture.name
    staged.mkdir()
    for path in fixture.iterdir():
        if path.suffix == ".xz":
            with lzma.open(path) as source, open(staged / path.stem, "wb") as sink:
                shutil.copyfileobj(source, sink)
        else:
            shutil.copy(path, staged / path.name)
    out = scratch_dir("materialized-")
    subprocess.run([sys.executable, str(fixture.parent / "materialize.py"), str(staged), str(out), "--dtype", dtype],
                   check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(staged.parent)
    return out


def random_prompt(vocab: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, vocab - 1, (1, length), generator=torch.Generator().manual_seed(seed))


def describe(result: dict) -> str:
    plain, spec = result["plain"], result["random_drafter"]
    lines = [f"plain {plain['tokens_per_s']:.1f} tok/s | DSpark random drafter {spec['tokens_per_s']:.1f} tok/s, "
             f"tau {spec['tau']:.2f}, round {spec['round_ms']:.1f} ms (draft {spec['draft_ms_per_round']:.1f}), "
             f"break-even tau {spec['break_even_tau']:.2f}, drafter on {result['drafter_device']}"]
    for name, row in result["projected"].items():
        lines.append(f"  projected at {name} (tau {row['tau']:.2f}): {row['tokens_per_s']:.1f} tok/s "
                     f"x{row['speedup']:.2f}")
    return "\n".join(lines)
