"""DSpark / DFlash training losses and metrics (DeepSpec `compute_dspark_loss` semantics).

Per drafted slot k (0-based) of a block, with weight w = eval_mask · exp(-k / decay):

- CE: cross-entropy of the (Markov-corrected) draft logits against the real next token;
- "l1" (TV): ||p_d - p_t||_1 between the draft and the aligned target distributions, *not* halved;
- confidence BCE: the confidence logit against α* = clamp(1 - 0.5·||p_d - p_t||_1, 0, 1) (detached), the
  probability that the slot's draft is accepted by rejection sampling at temperature 1.

`loss_terms` returns weighted *sums* (numerators); the caller divides by the global Σw so that gradient
accumulation and data parallelism give the same gradient as one big batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    decay_gamma: float = 4.0

    @classmethod
    def dspark(cls) -> LossWeights:
        return cls(ce=0.1, l1=0.9, confidence=1.0, decay_gamma=4.0)

    @classmethod
    def dflash(cls) -> LossWeights:
        return cls(ce=1.0, l1=0.0, confidence=0.0, decay_gamma=4.0)


def position_weights(eval_mask: torch.Tensor, decay_gamma: float) -> torch.Tensor:
    """w[..., k] = eval_mask[..., k] · exp(-k / decay_gamma)."""
    block_size = eval_mask.shape[-1]
    decay = torch.exp(-torch.arange(block_size, device=eval_mask.device, dtype=torch.float32) / decay_gamma)
    return eval_mask.float() * decay


def loss_terms(
    draft_logits: torch.Tensor,
    label_ids: torch.LongTensor,
    weights: torch.Tensor,
    target_logits: torch.Tensor | None = None,
    confidence_logits: torch.Tensor | None = None,
    loss_weights: LossWeights = LossWeights(),
) -> dict[str, torch.Tensor]:
    """Weighted sums over slots. `draft_logits`/`target_logits` [..., γ, V], `label_ids`/`weights`/`confidence_logits`
    [..., γ]. Returns `ce`, `l1`, `confidence`, `total` (= α_ce·ce + α_l1·l1 + α_conf·confidence, still a sum) and,
    when target logits are given, `alpha` [..., γ] (α*, detached) for the metrics."""
    weights = weights.float()
    draft_logits = draft_logits.float()
    vocab = draft_logits.shape[-1]
    ce = F.cross_entropy(draft_logits.reshape(-1, vocab), label_ids.reshape(-1), reduction="none")
    out = {"ce": (ce.view_as(weights) * weights).sum()}
    zero = out["ce"].new_zeros(())
    out["l1"] = zero
    out["confidence"] = zero
    if target_logits is not None:
        tv = (draft_logits.softmax(-1) - target_logits.float().softmax(-1)).abs().sum(-1)  # ||p_d - p_t||_1
        alpha = (1.0 - 0.5 * tv).clamp(0.0, 1.0).detach()
        out["alpha"] = alpha
        if loss_weights.l1 > 0:
            out["l1"] = (tv * weights).sum()
        if confidence_logits is not None and loss_weights.confidence > 0:
            bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), alpha, reduction="none")
            out["confidence"] = (bce * weights).sum()
    out["total"] = loss_weights.ce * out["ce"] + loss_weights.l1 * out["l1"] + loss_weights.confidence * out["confidence"]
    return out


def acceptance_metrics(
    alpha: torch.Tensor, eval_mask: torch.Tensor, confidence_logits: torch.Tensor | None = None
) -> dict[str, float]:
    """accept_rate@k (mean α* over valid slots k), expected τ = mean over full blocks of 1 + Σ_k Π_{i≤k} α*_i,
    and the confidence head's mean absolute error / bias against α*."""
    mask = eval_mask.float()
    metrics: dict[str, float] = {}
    block_size = alpha.shape[-1]
    flat_alpha, flat_mask = alpha.reshape(-1, block_size).float(), mask.reshape(-1, block_size)
    for k in range(block_size):
        count = flat_mask[:, k].sum()
        metrics[f"accept_rate@{k + 1}"] = float((flat_alpha[:, k] * flat_mask[:, k]).sum() / count) if count > 0 else math.nan
    full = flat_mask.all(dim=-1)
    if full.any():
        metrics["tau_expected"] = float((1 + flat_alpha[full].cumprod(dim=-1).sum(-1)).mean())
    if confidence_logits is not None:
        conf = torch.sigmoid(confidence_logits.float()).reshape(-1, block_size)
        count = flat_mask.sum().clamp(min=1)
        metrics["confidence_abs_error"] = float(((conf - flat_alpha).abs() * flat_mask).sum() / count)
        metrics["confidence_bias"] = float(((conf - flat_alpha) * flat_mask).sum() / count)
    return metrics
