"""One rank of the tensor-parallel smoke test (`test_big_targets.py::test_tensor_parallel_target_is_lossless`).

    torchrun --standalone --nproc_per_node 2 tests/tp_worker.py TARGET_DIR DRAFTER_DIR OUT_DIR

Loads the target with `tp_plan="auto"` (gloo on CPU) and writes, per rank, plain and DSpark greedy outputs (batch 1
and a left-padded batch 2) and the engine's outputs for the same prompts to OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import dspark_hf
from dspark_hf.models import placement
from dspark_hf.serving import DSparkEngine

PROMPTS = [[5, 6, 7, 8, 9], [11, 30, 12]]


def main(target_dir: str, drafter_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    target = AutoModelForCausalLM.from_pretrained(target_dir, tp_plan="auto", dtype=torch.float32).eval()
    drafter = dspark_hf.DSparkDraftModel.from_pretrained(drafter_dir).eval()
    result = {"single": [], "accepted": 0}
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        plain = target.generate(ids, max_new_tokens=16, do_sample=False)
        ours = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafter)
        result["single"].append([plain.tolist(), ours.tolist()])
        result["accepted"] += sum(drafter.generation_stats.accepted)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    result["batched"] = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                        assistant_model=drafter, pad_token_id=0).tolist()
    engine = DSparkEngine(target, drafter, default_sampling={"temperature": 0})
    handles = [engine.add_request(prompt, max_tokens=16) for prompt in PROMPTS]
    engine.run()
    result["engine"] = [handle.output().token_ids for handle in handles]
    result["head_view"] = isinstance(drafter.lm_head, placement.TargetHeadView)
    result["head_sharded"] = placement.is_distributed(target.lm_head)
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()  # (neither rank tears gloo down while the other still runs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
