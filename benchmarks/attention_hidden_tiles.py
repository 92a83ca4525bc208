"""What a key tile hidden by the mask costs the static-cache attention kernel (GPU diagnostic).

    PYTHONPATH=src python benchmarks/attention_hidden_tiles.py --out benchmarks/results/attention_hidden_tiles_h200.json

`generation.static_attention`'s kernel skips the K/V of a tile of `BLOCK_N` keys that the mask hides from every
query row, but still loads the mask's tile to find out. A static engine's rows see only their own columns of a cache
sized for the longest request (on the H200 the Qwen3-4B shape's rows left 75-79 % of the columns unseen at c = 128),
and the drafting engine's caches are longer than the no-speculation engine's (485 against 439 columns there: 8 key
tiles against 7). Here every batch row sees the same number of keys (`--visible`, at a random offset, as a row's
prompt padding and unwritten columns leave them) in caches of several lengths, with the Qwen3-4B shape's attention
(32 query heads, 8 K/V heads, head size 128, bf16, one query per row, an additive mask as transformers builds it).
Reported per batch size, with the mask alone and with each row's key bounds (`key_bounds`, which the static batch's
target forwards pass): the kernel's median µs per call at each cache length and, from a least-squares line over the
lengths, the µs each hidden tile adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment  # noqa: E402

from dspark_hf.generation.static_attention import BLOCK_N, split_kv_attention  # noqa: E402


def attention_inputs(batch: int, capacity: int, visible: int, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                     device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """(query [B, H, 1, d], key, value [B, KV, capacity, d], additive mask [B, 1, 1, capacity], key bounds [B, 2]):
    each row sees `visible` consecutive keys starting at a random column; its bounds are that range."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, 1, head_dim, generator=generator).to(device, dtype)
    key = torch.randn(batch, kv_heads, capacity, head_dim, generator=generator).to(device, dtype)
    value = torch.randn(batch, kv_heads, capacity, head_dim, generator=generator).to(device, dtype)
    start = torch.randint(0, capacity - visible + 1, (batch,), generator=generator)
    columns = torch.arange(capacity)
    seen = (columns >= start[:, None]) & (columns < start[:, None] + visible)
    mask = torch.zeros(batch, 1, 1, capacity).masked_fill(~seen[:, None, None], torch.finfo(dtype).min)
    bounds = torch.stack([start, start + visible], dim=-1)
    return query, key, value, mask.to(device, dtype), bounds.to(device)


def microseconds_per_call(inputs, calls: int, bounded: bool = False, graphed: int = 20) -> float:
    """GPU µs per call (with `bounded`, given the rows' key bounds): `graphed` calls captured in one CUDA graph (no
    launch overhead between them), the median over `calls` // `graphed` CUDA-event-timed replays."""
    query, key, value, mask, bounds = inputs
    scale = query.shape[-1] ** -0.5
    bounds = bounds if bounded else None
    for _ in range(3):
        split_kv_attention(query, key, value, mask, False, scale, bounds)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graphed):
            split_kv_attention(query, key, value, mask, False, scale, bounds)
    graph.replay()
    times = []
    for _ in range(max(1, calls // graphed)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / graphed)
    return statistics.median(times)


def hidden_tile_slope(capacities: list[int], visible: int, microseconds: list[float]) -> float:
    """µs per hidden tile: the least-squares slope of time over the number of hidden tiles."""
    hidden = [(capacity - visible) / BLOCK_N for capacity in capacities]
    return statistics.linear_regression(hidden, microseconds).slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--capacities", type=int, nargs="+", default=[256, 448, 512, 1024, 2048])
    parser.add_argument("--visible", type=int, default=128)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_hidden_tiles.py times the Triton kernel on a CUDA device.")
    report = dict(benchmark="attention_hidden_tiles", environment=environment(), visible=args.visible,
                  block_n=BLOCK_N, batches={})
    for batch in args.batches:
        entry = report["batches"][str(batch)] = {}
        inputs = [attention_inputs(batch, capacity, args.visible, device="cuda") for capacity in args.capacities]
        for bounded in (False, True):
            times = [microseconds_per_call(case, args.calls, bounded) for case in inputs]
            slope = hidden_tile_slope(args.capacities, args.visible, times)
            name = "key_bounds" if bounded else "mask_only"
            entry[name] = dict(microseconds={str(c): t for c, t in zip(args.capacities, times)},
                               microseconds_per_hidden_tile=slope)
            print(f"batch {batch:4d}, {name:10s}: " + ", ".join(f"{c} keys {t:.1f} us"
                                                                for c, t in zip(args.capacities, times))
                  + f"; {slope:.2f} us per hidden tile")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
