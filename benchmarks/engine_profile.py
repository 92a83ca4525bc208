"""Where an engine round goes on the GPU (diagnostic): no speculation and fixed γ=7 at concurrency 1, 2 and 8, each
cell's mean / median / slowest round and round breakdown (`serving.round_breakdown`), and torch.profiler tables for
two cells. `--model random` (default): a random model of the 50M fixture's shape (bf16), a random 2-layer drafter,
random 100-200-token prompts; `--model code50m`: the fixture, its trained drafter and HumanEval prompts (the serving
benchmark's setting).

`--compare-plain` checks why the no-speculation engine's rounds measured 15-65 ms slower in the serving benchmark than
the same forward at already-seen shapes (docs/serving.md): cuDNN attention building an execution plan for every new
shape. It times plain-decoding engine rounds three times per concurrency, each on prompts of fresh lengths except the
last: with DSpark's attention order (cuDNN last, `dspark_hf.decoding_attention`), with torch's own order
(`DSPARK_KEEP_SDPA_ORDER=1`) on new shapes, and with torch's order again on the same shapes.

    PYTHONPATH=src python benchmarks/engine_profile.py > benchmarks/results/engine_profile_h200.txt
    PYTHONPATH=src python benchmarks/engine_profile.py --model code50m --max-new-tokens 96
    PYTHONPATH=src python benchmarks/engine_profile.py --compare-plain
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402

import dspark_hf  # noqa: E402
from dspark_hf.scheduling import SPSTable  # noqa: E402
from dspark_hf.serving import DSparkEngine  # noqa: E402


def random_models(device: str = "cuda"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True, eos_token_id=2)
    with torch.device(device):
        target = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        drafter = dspark_hf.DSparkDraftModel(dspark_hf.DSparkConfig.from_target_config(
            config, mask_token_id=3, num_hidden_layers=2, block_size=7, markov_rank=32,
            enable_confidence_head=True)).to(torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 49152, (int(n),), generator=generator).tolist()
               for n in torch.randint(100, 200, (64,), generator=generator)]
    return target, drafter, prompts


def compare_plain(target, args) -> None:
    """Mean / median ms per plain round: cuDNN last vs torch's order on new shapes vs torch's order on seen shapes."""
    def prompts(lowest: int) -> list[list[int]]:  # 100-token length ranges: the two variants' shapes never meet
        generator = torch.Generator().manual_seed(lowest)
        return [torch.randint(4, target.config.vocab_size, (int(n),), generator=generator).tolist()
                for n in torch.randint(lowest, lowest + 100, (64,), generator=generator)]

    def timed(concurrency: int, batch: list[list[int]], keep_torch_order: bool) -> str:
        os.environ["DSPARK_KEEP_SDPA_ORDER"] = "1" if keep_torch_order else "0"
        engine = DSparkEngine(target, None, max_batch_size=concurrency, policy="none")
        _, seconds = serving.drive(engine, batch, concurrency, args)
        rounds = [entry["seconds"] for entry in engine.round_log]
        return f"{1e3 * seconds / len(rounds):.1f} ms/round (median {1e3 * statistics.median(rounds):.1f})"

    for concurrency in (1, 8, 64):  # each concurrency is a new batch size: new shapes for every variant
        cudnn_last, fresh = prompts(100), prompts(300)
        print(concurrency, "cuDNN last, new shapes     ", timed(concurrency, cudnn_last, False), flush=True)
        print(concurrency, "torch order, new shapes    ", timed(concurrency, fresh, True), flush=True)
        print(concurrency, "torch order, same shapes   ", timed(concurrency, fresh, True), flush=True)
    os.environ.pop("DSPARK_KEEP_SDPA_ORDER")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["random", "code50m"], default="random")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--no-profiler", dest="profiler", action="store_false")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compare-plain", action="store_true", help="only the plain-round comparison")
    options = parser.parse_args()
    if options.model == "random":
        target, drafter, prompts = random_models(options.device)
    else:
        target, drafter, prompts = serving.load_models("code50m", torch.bfloat16, options.device)
    args = argparse.Namespace(max_new_tokens=options.max_new_tokens, requests_per_slot=2)
    with torch.inference_mode():  # as serving.py (the SPS profile too)
        sps = SPSTable.profile(target, batch_tokens=(1, 8, 64, 512), context_length=256, repeats=3, progress=False)
        if options.compare_plain:
            return compare_plain(target, args)
        for concurrency in (1, 2, 8):
            for setting in (dict(policy="none"), dict(policy="fixed", gamma=7)):
                serving.run_cell(target, drafter, prompts, concurrency, setting, args, sps)  # warm-up
                cell = serving.run_cell(target, drafter, prompts, concurrency, setting, args, sps)
                print(concurrency, setting, f"round {cell['round_ms']:.1f} ms (median {cell['round_ms_median']:.1f}, "
                      f"max {cell['round_ms_max']:.1f}) tok/s {cell['tokens_per_second']:.0f}")
                breakdown = serving.round_breakdown(target, drafter, prompts, concurrency, setting, args, sps, None)
                print("   ", breakdown["ms_per_round"], flush=True)
        for concurrency, setting in ((2, dict(policy="none")), (8, dict(policy="fixed", gamma=7))) * options.profiler:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                serving.run_cell(target, drafter, prompts, concurrency, setting, args, sps)
            print(f"===== c={concurrency} {setting}")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=70))


if __name__ == "__main__":
    main()
