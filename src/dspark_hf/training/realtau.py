"""Real accepted length τ of a drafter being trained: `target.generate(..., assistant_model=drafter)` on held-out
prompts (batch 1, the library's own lossless decoding), aggregated over all rounds."""

from __future__ import annotations

import math

import torch

import dspark_hf  # noqa: F401  (installs the generate() hook)

from ..models import DSparkDraftModel


@torch.no_grad()
def measure_tau(target, drafter: DSparkDraftModel, prompts: list[torch.Tensor], max_new_tokens: int = 64,
                temperature: float = 0.0, seed: int = 0, eos_token_id=None) -> dict:
    """τ (committed tokens per round, bonus included) and accept_rate@k over `prompts` (1-D or [1, n] id tensors).

    The drafter is switched to sdpa attention and eval mode for the call and restored afterwards.
    """
    was_training = drafter.training
    implementation = drafter.config._attn_implementation
    if implementation not in ("sdpa", "eager"):
        drafter.set_attn_implementation("sdpa")
    drafter.eval()
    device = next(target.parameters()).device
    committed, drafted = [], []
    sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature,
                                                              "top_k": 0, "top_p": 1.0}
    extra = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    try:
        for index, prompt in enumerate(prompts):
            ids = prompt.reshape(1, -1).to(device)
            torch.manual_seed(seed + index)
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            assistant_model=drafter, **sampling, **extra)
            stats = drafter.generation_stats
            committed += stats.committed
            drafted += stats.drafted
    finally:
        if implementation not in ("sdpa", "eager"):
            drafter.set_attn_implementation(implementation)
        drafter.train(was_training)
    gamma = max(drafted, default=0)
    rates = []
    for k in range(gamma):
        proposed = [c - 1 for d, c in zip(drafted, committed) if d > k]
        rates.append(sum(a > k for a in proposed) / len(proposed) if proposed else math.nan)
    # Conditional acceptance: P(draft k accepted | drafts < k accepted).
    conditional = []
    for k in range(gamma):
        reached = [c - 1 for d, c in zip(drafted, committed) if d > k and c - 1 >= k]
        conditional.append(sum(a > k for a in reached) / len(reached) if reached else math.nan)
    return {"tau": sum(committed) / max(1, len(committed)), "rounds": len(committed),
            "accept_rate_by_position": rates, "conditional_acceptance": conditional}
