"""Where a static engine's warm-up spends its compile time (GPU diagnostic).

    PYTHONPATH=src TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python benchmarks/compile_breakdown.py \
        --model qwen3-4b-shape --concurrency 8 [--compile-layers-once] --out $OUT/compile_breakdown.json

Builds the no-speculation static engine (`DSparkEngine(static=True, policy="none")`, one row size: its plain round
and its admission chunk, two graphs), runs `warm_up()` and reports its seconds with torch's own compile-time
accounting (`torch._dynamo.utils.compile_times`: cumulative seconds per instrumented compiler phase, e.g. dynamo's
tracing, AOT autograd, inductor's lowering, code generation and kernel compilation; nested phases count in their
callers too). Run with inductor's caches disabled, or a second run finds the first one's kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, load_target  # noqa: E402

from dspark_hf.generation import compile_layers_once  # noqa: E402
from dspark_hf.serving import DSparkEngine  # noqa: E402


def phase_seconds() -> dict[str, float]:
    """torch's compile-time table as {phase: total seconds}, largest first."""
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    return dict(sorted(((name, float(value)) for name, value in zip(names, values)), key=lambda item: -item[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["code50m", "qwen3-4b-shape"], default="qwen3-4b-shape")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--compile-layers-once", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    target = load_target(args.model, torch.bfloat16, args.device).eval()
    if args.compile_layers_once:
        compile_layers_once(target)
    with torch.inference_mode():
        engine = DSparkEngine(target, None, static=True, policy="none", max_batch_size=args.concurrency,
                              max_model_len=512, static_compile=True, static_graph_batch_sizes={args.concurrency},
                              static_admission_rows=min(16, args.concurrency))
        started = time.perf_counter()
        graphs = engine.warm_up(progress=True)
        seconds = time.perf_counter() - started
    report = dict(environment=environment(), model=args.model, concurrency=args.concurrency,
                  compile_layers_once=args.compile_layers_once, graphs=graphs, warm_up_seconds=seconds,
                  phase_seconds=phase_seconds())
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({key: value for key, value in report.items() if key != "environment"}, indent=1)[:3000])


if __name__ == "__main__":
    main()
