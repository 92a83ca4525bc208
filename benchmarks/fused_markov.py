"""The greedy Markov loop alone: the drafter's own loop against the fused kernel (`generation/fused_markov.py`).

For each case (vocabulary, Markov rank, batch rows, drafted slots) a random bf16 vanilla Markov head and float32
base logits; both loops compiled (`torch.compile(fullgraph=True)`), captured as one CUDA graph each and replayed:
device µs per loop, kernels per loop (torch.profiler over the replays), and whether the drafts are equal (the bias
is summed in another order, so a near-tie may go the other way; `drafts_equal` counts the slots that agree).

    PYTHONPATH=src:benchmarks python benchmarks/fused_markov.py --out $OUT/fused_markov.json

Cases by default: the 50M fixture's drafter (49,152 × 32) and a Qwen3 drafter's (151,936 × 256), 7 slots, batch 1 and
64. CUDA only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import environment
from cuda_graph_replay import captured, timed
from torch.profiler import ProfilerActivity, profile

from dspark_hf.generation.fused_markov import draft_tokens, fused_markov_applies
from dspark_hf.models import DSparkConfig, DSparkDraftModel, greedy_selector

CASES = ("49152:32:1:7", "49152:32:64:7", "151936:256:1:7", "151936:256:64:7")


def drafter_with_markov_head(vocab: int, rank: int) -> DSparkDraftModel:
    """A one-layer bf16 drafter whose Markov head (the only part used) has random weights at the given size."""
    config = DSparkConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, target_layer_ids=[0],
                          num_target_layers=1, mask_token_id=3, block_size=8, markov_rank=rank)
    drafter = DSparkDraftModel(config).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.normal_(0.0, 1.0)
        drafter.markov_head.markov_w2.weight.normal_(0.0, rank ** -0.5)
    return drafter


def measure(case: str, replays: int) -> dict:
    vocab, rank, batch, slots = map(int, case.split(":"))
    torch.manual_seed(0)
    drafter = drafter_with_markov_head(vocab, rank)
    anchor = torch.randint(vocab, (batch,), device="cuda")
    hidden = torch.randn(batch, slots, 64, device="cuda", dtype=torch.bfloat16)
    base_logits = 3 * torch.randn(batch, slots, vocab, device="cuda")
    assert fused_markov_applies(drafter, base_logits)
    loops = {
        "drafter_loop": lambda: drafter.draft_tokens(anchor, hidden, base_logits, greedy_selector).tokens,
        "fused": lambda: draft_tokens(drafter, anchor, hidden, base_logits)[0],
    }
    entry, drafts = dict(vocab=vocab, rank=rank, batch=batch, slots=slots), {}
    for name, loop in loops.items():
        compiled = torch.compile(loop, fullgraph=True, dynamic=False)
        out = {}

        def step(compiled=compiled, out=out):
            out["drafts"] = compiled()

        graph = captured(step)
        graph.replay()
        timed(graph.replay, 20)
        times = timed(graph.replay, replays)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        entry[name] = dict(device_us=1e3 * times["gpu_ms"], kernels=len(kernels) / 10,
                           kernel_us=sum(e.device_time for e in kernels) / 10)
        drafts[name] = out["drafts"].clone()
    entry["drafts_equal"] = (drafts["fused"] == drafts["drafter_loop"]).float().mean().item()
    entry["speedup"] = entry["drafter_loop"]["device_us"] / entry["fused"]["device_us"]
    print(json.dumps(entry), flush=True)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="vocab:rank:batch:slots")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("fused_markov.json"))
    args = parser.parse_args()
    report = dict(benchmark="fused_markov", environment=environment(),
                  cases=[measure(case, args.replays) for case in args.cases])
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
