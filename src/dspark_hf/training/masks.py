"""Anchors and the block attention mask of DSpark/DFlash training (DeepSpec `common.py` semantics).

A training sequence of S tokens gets up to A anchors. Block b reads `[x[anchor_b], mask × (γ-1)]` at positions
`anchor_b + j`; slot j predicts `x[anchor_b + j + 1]`. Queries are the A·γ block tokens; keys are the S target
context positions followed by the A·γ block tokens. Block b sees the context strictly before its anchor and all γ
tokens of its own block (bidirectionally); padding blocks see nothing they could learn from.

The mask comes from one predicate, `block_mask_predicate`, evaluated densely (a bool tensor, CPU / sdpa) or as a
flex_attention `BlockMask` (GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AnchorBatch:
    """Anchors of a batch. `positions` [B, A] (ascending, padding = 0), `keep` [B, A] bool (real anchors)."""

    positions: torch.LongTensor
    keep: torch.BoolTensor


def anchor_candidates(loss_mask: torch.Tensor) -> torch.BoolTensor:
    """Positions p with loss_mask[p] and loss_mask[p+1] (so the first label, p+1, is trained) -> [B, S] bool."""
    valid = loss_mask > 0.5
    candidates = torch.zeros_like(valid)
    candidates[:, :-1] = valid[:, :-1] & valid[:, 1:]
    return candidates


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generators: list[torch.Generator] | torch.Generator | None = None
) -> AnchorBatch:
    """Up to `num_anchors` anchors per row, uniformly without replacement among the candidates, then sorted.

    `generators`: one CPU generator per row (makes a row's anchors independent of how rows are batched or split
    across processes), a single generator, or None (global RNG). Rows with fewer candidates get padding anchors.
    """
    candidates = anchor_candidates(loss_mask).cpu()
    batch, seq_len = candidates.shape
    if not isinstance(generators, (list, tuple)):
        generators = [generators] * batch
    keys = torch.stack([torch.rand(seq_len, generator=g) for g in generators])
    keys = torch.where(candidates, keys, torch.full_like(keys, 2.0))  # non-candidates sort last
    count = min(num_anchors, seq_len)
    order = keys.argsort(dim=1)[:, :count]
    keep = torch.gather(candidates, 1, order)
    positions = torch.where(keep, order, torch.full_like(order, seq_len))  # padding sorts after real anchors
    positions, sort_idx = positions.sort(dim=1)
    keep = torch.gather(keep, 1, sort_idx)
    positions = torch.where(keep, positions, torch.zeros_like(positions))
    if count < num_anchors:  # pad to a fixed A so batches stack
        pad = num_anchors - count
        positions = torch.cat([positions, positions.new_zeros(batch, pad)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(batch, pad)], dim=1)
    device = loss_mask.device
    return AnchorBatch(positions.to(device), keep.to(device))


def block_mask_predicate(anchor_positions: torch.Tensor, block_keep: torch.Tensor, seq_len: int, block_size: int):
    """`mask(b, h, q_idx, kv_idx) -> bool`: may block query q_idx attend key kv_idx (works on index tensors)."""

    def mask(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        anchor = anchor_positions[b, q_block]
        in_context = (kv_idx < seq_len) & (kv_idx < anchor)
        own_block = (kv_idx >= seq_len) & (q_block == (kv_idx - seq_len) // block_size)
        return (in_context | own_block) & block_keep[b, q_block]

    return mask


def dense_block_mask(anchors: AnchorBatch, seq_len: int, block_size: int) -> torch.BoolTensor:
    """The predicate evaluated on the full grid -> [B, 1, A·γ, S + A·γ] bool (True = attend), for sdpa.

    Padding blocks would attend to nothing (NaN rows under softmax), so they see their own block instead; their
    outputs are excluded from every loss.
    """
    batch, num_anchors = anchors.positions.shape
    q_len = num_anchors * block_size
    device = anchors.positions.device
    keep_all = torch.ones_like(anchors.keep)
    predicate = block_mask_predicate(anchors.positions, keep_all, seq_len, block_size)
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(q_len, device=device)[None, :, None]
    kv = torch.arange(seq_len + q_len, device=device)[None, None, :]
    return predicate(b, None, q, kv)[:, None]


def flex_block_mask(anchors: AnchorBatch, seq_len: int, block_size: int, num_heads: int | None = None):
    """The same predicate as a flex_attention `BlockMask` (sparse: skips fully masked 128×128 tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_anchors = anchors.positions.shape
    q_len = num_anchors * block_size
    keep_all = torch.ones_like(anchors.keep)  # see `dense_block_mask`: no empty rows
    predicate = block_mask_predicate(anchors.positions, keep_all, seq_len, block_size)
    return create_block_mask(
        predicate, B=batch, H=None, Q_LEN=q_len, KV_LEN=seq_len + q_len, device=anchors.positions.device
    )


def additive_mask(mask: torch.BoolTensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (True = attend) -> additive float mask for eager attention."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


@dataclass
class BlockLayout:
    """Everything the drafter's training forward needs besides features, built from the anchors.

    `block_ids` [B, A, γ], `position_ids` [B, A·γ], `label_ids` [B, A, γ] (token at anchor+j+1, 0 where outside),
    `label_positions` [B, A, γ] (anchor+j+1, clamped), `eval_mask` [B, A, γ] float (contiguous valid prefix),
    `prev_ids` [B, A, γ] (teacher-forced predecessors: anchor token, y_1..y_{γ-1}).
    """

    anchors: AnchorBatch
    block_ids: torch.LongTensor
    position_ids: torch.LongTensor
    label_ids: torch.LongTensor
    label_positions: torch.LongTensor
    eval_mask: torch.Tensor
    prev_ids: torch.LongTensor


def build_block_layout(
    input_ids: torch.LongTensor, loss_mask: torch.Tensor, anchors: AnchorBatch, block_size: int, mask_token_id: int
) -> BlockLayout:
    batch, seq_len = input_ids.shape
    positions, keep = anchors.positions, anchors.keep
    offsets = torch.arange(block_size, device=input_ids.device)
    slot_positions = positions[:, :, None] + offsets  # [B, A, γ]
    anchor_tokens = torch.gather(input_ids, 1, positions)
    anchor_tokens = torch.where(keep, anchor_tokens, torch.full_like(anchor_tokens, mask_token_id))
    block_ids = torch.full_like(slot_positions, mask_token_id)
    block_ids[:, :, 0] = anchor_tokens

    label_positions = slot_positions + 1
    inside = label_positions < seq_len
    label_positions = label_positions.clamp(max=seq_len - 1)
    flat = label_positions.reshape(batch, -1)
    label_ids = torch.gather(input_ids, 1, flat).reshape_as(label_positions)
    label_valid = torch.gather(loss_mask > 0.5, 1, flat).reshape_as(label_positions)
    valid = inside & label_valid & keep[:, :, None]
    eval_mask = valid.long().cumprod(dim=-1).to(torch.float32)
    label_ids = torch.where(inside, label_ids, torch.zeros_like(label_ids))
    prev_ids = torch.cat([anchor_tokens[:, :, None], label_ids[:, :, :-1]], dim=-1)
    return BlockLayout(
        anchors=anchors,
        block_ids=block_ids,
        position_ids=slot_positions.reshape(batch, -1),
        label_ids=label_ids,
        label_positions=label_positions,
        eval_mask=eval_mask,
        prev_ids=prev_ids,
    )
