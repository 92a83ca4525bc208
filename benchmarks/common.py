"""Helpers shared by the benchmark scripts: environment record, fixtures, prompts."""

from __future__ import annotations

import atexit
import gzip
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
RESULTS = REPO / "benchmarks" / "results"


def environment() -> dict:
    """Machine and versions, recorded with every result."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cuda_graphs": os.environ.get("DSPARK_CUDA_GRAPHS", "direct"),  # dspark_hf.generation.cuda_graphs
        "fused_markov": os.environ.get("DSPARK_FUSED_MARKOV", "1"),  # dspark_hf.generation.fused_markov
        "skinny_linear": os.environ.get("DSPARK_SKINNY_LINEAR", "unset (off)"),  # dspark_hf.generation.skinny_linear
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["git_commit"] = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO, text=True).strip()
        # (on the device machine the working tree is copied over an older checkout's .git: HEAD alone can be stale)
        info["git_dirty"] = bool(subprocess.check_output(["git", "status", "--porcelain", "--", "src", "benchmarks"],
                                                         cwd=REPO, text=True).strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    info["source_sha256"] = source_digest()
    return info


def source_digest() -> str:
    """sha256 over the library's and the benchmarks' Python files (paths and contents): which code produced a
    result, whatever the git metadata around it says. `git ls-files src benchmarks` fed to the same hash checks it."""
    digest = hashlib.sha256()
    for path in sorted(p for folder in ("src", "benchmarks") for p in (REPO / folder).rglob("*.py")):
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def scratch_dir(prefix: str = "dspark-bench-") -> Path:
    """A new temporary folder that is removed when the process exits (a materialized fixture is ~200 MB: left
    behind by every benchmark run and test, they filled the disk)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def materialize_fixture(name: str, dtype: str = "float32") -> Path:
    """The ../shared fixture as a standard HF folder (in a temporary folder removed at exit)."""
    out = scratch_dir(f"{name}-")
    subprocess.run([sys.executable, str(SHARED / "fixtures" / "materialize.py"), name, str(out), "--dtype", dtype],
                   check=True, stdout=subprocess.DEVNULL)
    return out


def humaneval_prompts(count: int) -> list[str]:
    with gzip.open(SHARED / "data" / "humaneval" / "HumanEval.jsonl.gz", "rt") as handle:
        return [json.loads(line)["prompt"] for line, _ in zip(handle, range(count))]


STDLIB_MODULES = ("json.decoder", "textwrap", "argparse", "csv", "fractions", "heapq", "bisect", "shlex",
                  "calendar", "difflib", "statistics", "string", "colorsys", "fnmatch", "glob", "ipaddress")


def stdlib_code_prompts(count: int, lines: int = 30) -> list[str]:
    """Held-out code prompts: `lines` lines of CPython stdlib modules (the code fixtures were not trained on the
    stdlib), cut right after a `def` line (no newline) so the model continues a function body."""
    import importlib
    import inspect

    prompts = []
    for name in STDLIB_MODULES:
        source = inspect.getsource(importlib.import_module(name)).splitlines()
        defs = [i for i, line in enumerate(source) if line.lstrip().startswith("def ") and i >= lines]
        if defs:
            end = defs[len(defs) // 2] + 1
            prompts.append("\n".join(source[end - lines:end]))  # no trailing newline: BPE merges it with the indent
        if len(prompts) == count:
            break
    return prompts


QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True)


def load_target(name: str, dtype: torch.dtype, device: str):
    """`code50m` (the 50M code fixture) or `qwen3-4b-shape` (random init, Qwen3-4B's shapes: timing only)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if name == "code50m":
        return AutoModelForCausalLM.from_pretrained(materialize_fixture("code-llama-50m"), dtype=dtype).to(device)
    if name == "qwen3-4b-shape":
        with torch.device(device):
            return AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_4B), dtype=dtype)
    raise ValueError(f"unknown model {name!r}")


def write_report(prefix: str, report: dict, **fields) -> Path:
    """An evaluation report (`run_evaluation`'s output) as RESULTS/<prefix>.json, with its plots as <prefix>_*.png."""
    from dspark_hf.evaluation import plot_report

    for path in plot_report(report, scratch_dir()):
        shutil.copy(path, RESULTS / f"{prefix}_{path.name}")
    return write_json(f"{prefix}.json", {**fields, **report})


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
