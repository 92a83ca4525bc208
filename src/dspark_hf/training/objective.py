"""`DraftObjective`: the drafter's training forward for one batch, as an `nn.Module` (the unit DDP/FSDP wraps).

Inputs: the token batch, its loss mask, the target's features and the sampled anchors. Steps: block layout (ids,
positions, labels, contiguous-valid-prefix eval mask) -> block attention mask -> drafter backbone -> draft logits
+ teacher-forced Markov bias -> confidence logits -> weighted loss sums (numerators; see `losses.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models import DSparkDraftModel
from .features import TargetFeatures
from .losses import LossWeights, loss_terms, position_weights
from .masks import AnchorBatch, BlockLayout, additive_mask, build_block_layout, dense_block_mask, flex_block_mask


class DraftObjective(nn.Module):
    def __init__(self, drafter: DSparkDraftModel, target_lm_head: nn.Module, loss_weights: LossWeights,
                 softcap: float | None = None):
        super().__init__()
        self.drafter = drafter
        self.loss_weights = loss_weights
        # The target's LM head is the drafter's (shared, frozen); kept out of this module's parameters.
        self._target_head = [target_lm_head]
        self.softcap = softcap
        self.loss_fn = loss_terms  # the trainer may swap in a torch.compile'd version
        self.compute_alpha = True  # α* metrics even when no loss term needs the target's distribution

    def layout(self, input_ids: torch.LongTensor, loss_mask: torch.Tensor, anchors: AnchorBatch) -> BlockLayout:
        config = self.drafter.config
        return build_block_layout(input_ids, loss_mask, anchors, config.block_size, config.mask_token_id)

    def attention_mask(self, layout: BlockLayout, seq_len: int):
        block_size = self.drafter.config.block_size
        implementation = self.drafter.config._attn_implementation
        if implementation == "flex_attention":
            return flex_block_mask(layout.anchors, seq_len, block_size)
        mask = dense_block_mask(layout.anchors, seq_len, block_size)
        if implementation == "eager":
            return additive_mask(mask, self.drafter.fc.weight.dtype)
        return mask

    def _logits(self, hidden: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        """Logits through the shared LM head (float32); the drafter's own logits are never soft-capped (as at
        inference), the target's are when its config says so."""
        weight = self._target_head[0].weight
        logits = nn.functional.linear(hidden.to(weight.dtype), weight).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def forward(self, input_ids: torch.LongTensor, loss_mask: torch.Tensor, target_hidden: torch.Tensor,
                target_last_hidden: torch.Tensor | None, anchor_positions: torch.LongTensor,
                anchor_keep: torch.BoolTensor) -> dict[str, torch.Tensor]:
        """Plain tensors in (DDP moves and hooks them): the token batch [B, S], its loss mask, the target's features
        [B, S, K·H] and post-norm last hidden states [B, S, H] (None: no TV/confidence terms), the anchors [B, A]."""
        drafter = self.drafter
        features = TargetFeatures(target_hidden, target_last_hidden)
        anchors = AnchorBatch(anchor_positions, anchor_keep)
        batch, seq_len = input_ids.shape
        num_anchors, block_size = anchors.positions.shape[1], drafter.config.block_size
        layout = self.layout(input_ids, loss_mask, anchors)
        context_positions = torch.arange(seq_len, device=input_ids.device).expand(batch, -1)
        hidden = drafter(
            input_ids=layout.block_ids.reshape(batch, -1),
            target_hidden_states=features.hidden,
            position_ids=layout.position_ids,
            context_position_ids=context_positions,
            attention_mask=self.attention_mask(layout, seq_len),
        ).last_hidden_state.view(batch, num_anchors, block_size, -1)

        draft_logits = self._logits(hidden)
        if drafter.markov_head is not None:
            draft_logits = draft_logits + drafter.markov_head.block_bias(layout.prev_ids, hidden).float()
        confidence = drafter.confidence_logits(hidden, layout.prev_ids)

        target_logits = None
        needs_target = self.loss_weights.l1 > 0 or self.loss_weights.confidence > 0 or self.compute_alpha
        if needs_target and features.last_hidden is not None:
            with torch.no_grad():
                # The target's distribution for the token at anchor+j+1 comes from its hidden state at anchor+j.
                source = (layout.label_positions - 1).reshape(batch, -1, 1).expand(-1, -1, features.last_hidden.shape[-1])
                aligned = torch.gather(features.last_hidden, 1, source).view(batch, num_anchors, block_size, -1)
                target_logits = self._logits(aligned, self.softcap)

        weights = position_weights(layout.eval_mask, self.loss_weights.decay_gamma)
        terms = self.loss_fn(draft_logits, layout.label_ids, weights, target_logits, confidence, self.loss_weights)
        terms["weight_sum"] = weights.sum()
        terms["eval_mask"] = layout.eval_mask
        terms["confidence_logits"] = confidence.detach() if confidence is not None else None
        with torch.no_grad():
            correct = (draft_logits.argmax(-1) == layout.label_ids).float() * layout.eval_mask
            terms["top1_correct"] = correct
        return terms
