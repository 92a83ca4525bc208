"""Batched greedy decoding on static KV caches with a write position per row: the batch > 1 fast path (experimental).

`static_generate_batch(target, drafter, input_ids, attention_mask, max_new_tokens)` decodes a left-padded batch
greedily, like `generate(assistant_model=drafter)` with a fixed verify length (every round verifies all γ drafts of
every row), and every round is the same function of the same shapes:

- target and drafter each keep a `RowStaticCache`: [B, heads, capacity, d] buffers whose write position is per row,
  so a row's new states go to its own next columns. Rows that accepted different numbers of drafts stay dense: row
  b's column c always holds its position c - pad_b (pad_b: its left padding), and a rejected draft's column is
  simply written again by the next round;
- a round drafts from each row's previous verify features (the first a_b + 1 of them are context, the attention
  mask hides the rest), runs the Markov loop, the target's forward over [anchor, γ drafts] of every row, greedy
  acceptance, and moves each row's write positions past its accepted tokens;
- the rows' state lives in device buffers updated in place, so `compile=True` can capture a round as one CUDA graph
  (`torch.compile(mode="reduce-overhead")`); the host reads one record per round (one synchronisation).

`drafter=None` decodes plainly on the same caches: the fast plain baseline at batch B. Greedy only; a row stops at
its first eos or after `max_new_tokens`; rows that have stopped keep computing (their tokens are dropped) until all
have. Each row equals its solo plain `generate()` in float32 (tests/test_static_batch.py). Attention runs through
the models' own implementation with a 4D mask (sdpa by default); the batch-1 loop's Triton kernel is not used.
"""

from __future__ import annotations

import weakref

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer

from ..models import DSparkDraftModel, TargetLayerTap
from ..models.modeling import greedy_selector
from ..tensor_ops import argmax_last
from .batched import BatchedDSparkStats
from .candidate_generator import DSparkStats
from .speculative_rows import check_batchable_target
from .target_features import check_drafter_fits_target


class RowStaticLayer(StaticLayer):
    """A `StaticLayer` whose write position is per row: `cumulative_length` [B]; `update` writes row b's T new
    states at columns cumulative_length[b] .. + T - 1 and advances it by T."""

    def __init__(self, max_cache_len: int, batch_size: int, device: torch.device):
        super().__init__(max_cache_len=max_cache_len)
        self.cumulative_length = torch.zeros(batch_size, dtype=torch.long, device=device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        columns = self.cumulative_length[:, None] + torch.arange(key_states.shape[-2], device=self.device)
        self.cumulative_length.add_(key_states.shape[-2])
        for cache, states in ((self.keys, key_states), (self.values, value_states)):
            cache.scatter_(2, columns[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[-1]), states)
        return self.keys, self.values


class RowStaticCache(Cache):
    """One `RowStaticLayer` per attention layer of a model: `capacity` columns for each of `batch_size` rows."""

    def __init__(self, num_layers: int, capacity: int, batch_size: int, device: torch.device):
        super().__init__(layers=[RowStaticLayer(capacity, batch_size, device) for _ in range(num_layers)])
        self.capacity = capacity

    def move_to(self, columns: torch.Tensor) -> None:
        """Sets every row's write position (`columns` [B], on the device: no host sync)."""
        for layer in self.layers:
            layer.cumulative_length.copy_(columns)


def visible_columns(pad: torch.Tensor, first_query: torch.Tensor, queries: int, capacity: int, causal: bool,
                    dtype: torch.dtype) -> torch.Tensor:
    """An additive [B, 1, queries, capacity] mask: query j of row b sees columns pad_b .. first_query_b + j (causal)
    or pad_b .. first_query_b - 1 (not causal: the cache holds context only)."""
    columns = torch.arange(capacity, device=pad.device)
    offsets = torch.arange(queries, device=pad.device) if causal else torch.full((queries,), -1, device=pad.device)
    last = first_query[:, None] + offsets  # [B, Q]: each query's last visible column
    seen = (columns >= pad[:, None, None]) & (columns <= last[:, :, None])
    return torch.zeros(seen.shape, dtype=dtype, device=pad.device).masked_fill(~seen, torch.finfo(dtype).min)[:, None]


class StaticBatchRounds:
    """Target (and drafter) on `RowStaticCache`s for `batch_size` rows of `capacity` columns, the rows' state in
    device buffers, and `step()`: one round (`compiled` when compiling) that records its result in `record`.

    `StaticBatchRounds.for_models(...)` keeps the last one built for a drafter (or a target decoding plainly) and
    reuses it for the same batch size while it fits, so repeated calls neither reallocate nor recompile."""

    _kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def for_models(cls, target: PreTrainedModel, drafter: DSparkDraftModel | None, batch_size: int, capacity: int,
                   compile: bool | dict = False) -> StaticBatchRounds:
        owner = drafter if drafter is not None else target
        kept = cls._kept.get(owner)
        if kept is None or kept.key != cls.key_of(target, batch_size, compile) or kept.capacity < capacity:
            kept = cls._kept[owner] = cls(target, drafter, batch_size, capacity, compile)
        return kept

    @staticmethod
    def key_of(target: PreTrainedModel, batch_size: int, compile: bool | dict) -> tuple:
        """What must match for a kept instance to be reused (besides fitting the length)."""
        return id(target), batch_size, repr(compile)

    def __init__(self, target: PreTrainedModel, drafter: DSparkDraftModel | None, batch_size: int, capacity: int,
                 compile: bool | dict = False):
        check_batchable_target(target)
        self.target, self.drafter, self.capacity = target, drafter, capacity
        self.key = self.key_of(target, batch_size, compile)
        device = target.device
        text = target.config.get_text_config()
        self.target_cache = RowStaticCache(text.num_hidden_layers, capacity, batch_size, device)
        self.tap = None
        self.drafter_cache = None
        self.width = 1  # tokens a round runs the target on per row
        if drafter is not None:
            check_drafter_fits_target(drafter.config, target)
            drafter.share_target_weights(target)
            self.tap = TargetLayerTap(target, drafter.config.target_layer_ids)
            self.drafter_cache = RowStaticCache(drafter.config.num_hidden_layers, capacity, batch_size, device)
            self.width = drafter.config.num_draft_slots + 1
        long = dict(dtype=torch.long, device=device)
        self.pad = torch.zeros(batch_size, **long)  # left padding: row b's column c is its position c - pad_b
        self.anchor = torch.zeros(batch_size, **long)  # the last committed token, not yet in the target cache
        self.column = torch.zeros(batch_size, **long)  # the anchor's column
        self.context_column = torch.zeros(batch_size, **long)  # where `features` start (DSpark)
        self.active = torch.ones(batch_size, **long)  # 0 once a row has stopped: its columns stop moving
        self.features: torch.Tensor | None = None  # [B, γ + 1, K·H]: the last verify forward's target features
        self.record = torch.zeros(batch_size, 1 + self.width, **long)  # [accepted, emitted tokens] per row
        self.drafts = torch.zeros(batch_size, self.width - 1, **long)  # the last round's drafts
        self.step = self._plain_round if drafter is None else self._dspark_round
        self.compiled = self.step
        if compile:
            for buffer in (self.pad, self.anchor, self.column, self.context_column, self.active, self.record,
                           self.drafts):
                torch._dynamo.mark_static_address(buffer)
            options = compile if isinstance(compile, dict) else dict(mode="reduce-overhead", dynamic=False)
            self.compiled = torch.compile(self.step, **options)

    # ------------------------------------------------------------------ target
    def _target_forward(self, ids: torch.LongTensor, first_column: torch.Tensor):
        """The target over `ids` [B, T] written from `first_column` [B] -> (float32 logits, features or None)."""
        self.target_cache.move_to(first_column)
        positions = (first_column - self.pad)[:, None] + torch.arange(ids.shape[1], device=ids.device)
        mask = visible_columns(self.pad, first_column, ids.shape[1], self.capacity, True, self.target.dtype)
        logits = self.target(input_ids=ids, position_ids=positions.clamp(min=0), attention_mask=mask,
                             past_key_values=self.target_cache, use_cache=True).logits.float()
        return logits, self.tap.features() if self.tap is not None else None

    def prefill(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor) -> None:
        """The left-padded prompts [B, W]: fills the caches, picks each row's first token (in `record`)."""
        device = self.target.device
        self.pad.copy_((attention_mask == 0).sum(dim=1).to(device))
        start = torch.zeros_like(self.pad)
        with self.tap if self.tap is not None else torch.no_grad():
            logits, features = self._target_forward(input_ids.to(device), start)
        self.anchor.copy_(argmax_last(logits[:, -1]))
        self.column.fill_(input_ids.shape[1])
        self.active.fill_(1)
        self.record.zero_()
        self.record[:, 1] = self.anchor
        if self.drafter is None:
            return
        # the drafter's context K/V for all prompt columns but the last γ + 1, which a round's features cover
        width = self.width
        context = input_ids.shape[1] - width
        self.drafter_cache.move_to(start)
        block = torch.full((self.pad.shape[0], 1), self.drafter.config.mask_token_id, dtype=torch.long, device=device)
        mask = visible_columns(self.pad, torch.full_like(self.pad, context), 1, self.capacity + 1, False,
                               self.drafter.compute_dtype)
        columns = torch.arange(context, device=device)[None] - self.pad[:, None]
        self.drafter(input_ids=block, target_hidden_states=features[:, :context], past_key_values=self.drafter_cache,
                     context_position_ids=columns.clamp(min=0), position_ids=(context - self.pad)[:, None],
                     attention_mask=mask)
        if self.features is None or self.features.shape != features[:, context:].shape:  # kept across calls
            self.features = torch.empty_like(features[:, context:], memory_format=torch.contiguous_format)
            torch._dynamo.mark_static_address(self.features)  # updated in place: CUDA graphs keep its address
        self.features.copy_(features[:, context:])
        self.context_column.fill_(context)

    # ------------------------------------------------------------------ rounds
    def _plain_round(self) -> None:
        logits, _ = self._target_forward(self.anchor[:, None], self.column)
        token = argmax_last(logits[:, -1])
        self.record[:, 0] = 0
        self.record[:, 1] = token
        self.anchor.copy_(token)
        self.column.add_(self.active)

    def _dspark_round(self) -> None:
        drafter, device = self.drafter, self.anchor.device
        block = drafter.config.block_size
        # the previous verify features are context up to the anchor's column; the rest is hidden, then overwritten
        self.drafter_cache.move_to(self.context_column)
        mask = visible_columns(self.pad, self.column, block, self.capacity, False, drafter.compute_dtype)
        mask = torch.cat([mask, mask.new_zeros(mask.shape[0], 1, block, block)], dim=-1)
        context_positions = (self.context_column - self.pad)[:, None] + torch.arange(self.width, device=device)
        hidden, base_logits = drafter.draft_backbone(
            self.anchor, self.features, self.drafter_cache,
            position_ids=(self.column - self.pad)[:, None] + torch.arange(block, device=device),
            context_position_ids=context_positions.clamp(min=0), attention_mask=mask)
        drafts = drafter.draft_tokens(self.anchor, hidden, base_logits, greedy_selector).tokens
        ids = torch.cat([self.anchor[:, None], drafts], dim=1)
        logits, features = self._target_forward(ids, self.column)
        tokens = argmax_last(logits)  # [B, γ + 1]
        accepted = (drafts == tokens[:, :-1]).long().cumprod(dim=1).sum(dim=1)
        self.record[:, 0] = accepted
        self.record[:, 1:] = tokens
        self.drafts.copy_(drafts)
        self.anchor.copy_(tokens.gather(1, accepted[:, None])[:, 0])
        self.features.copy_(features)
        # the old column computed from the new one: inductor may apply a copy of the `self.column` alias after updating
        # it (static_loop.StaticRound.advance)
        moved = (accepted + 1) * self.active
        column = self.column + moved
        self.context_column.copy_(column - moved)
        self.column.copy_(column)


@torch.no_grad()
def static_generate_batch(
    target: PreTrainedModel,
    drafter: DSparkDraftModel | None,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
    *,
    eos_token_id: int | list[int] | None = None,
    compile: bool | dict = False,
) -> list[list[int]]:
    """Left-padded prompts [B, W] (`attention_mask` 1 on real tokens; None: no padding) -> each row's new tokens
    (at most `max_new_tokens`, up to and including its first eos). `drafter=None` decodes plainly. `compile`: True
    for `torch.compile(mode="reduce-overhead", dynamic=False)` of the round, or a dict of `torch.compile` options.
    Per-row round statistics go to `drafter.generation_stats` (a `BatchedDSparkStats`). Caches and the compiled
    round are kept for the next call of the same batch size (`StaticBatchRounds.for_models`)."""
    if input_ids.dim() != 2:
        raise ValueError(f"static_generate_batch() takes left-padded prompts [B, W]; got {tuple(input_ids.shape)}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not bool(attention_mask.any(dim=1).all()):
        raise ValueError("static_generate_batch() needs at least one prompt token per row.")
    width = 1 if drafter is None else drafter.config.num_draft_slots + 1
    if input_ids.shape[1] <= width:  # the drafter's first context must precede a round's γ + 1 features
        extra = width + 1 - input_ids.shape[1]
        input_ids = torch.nn.functional.pad(input_ids, (extra, 0))
        attention_mask = torch.nn.functional.pad(attention_mask, (extra, 0))
    capacity = input_ids.shape[1] + max_new_tokens + 2 * width
    rounds = StaticBatchRounds.for_models(target, drafter, input_ids.shape[0], capacity, compile)
    eos = target.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    rounds.prefill(input_ids, attention_mask)
    first = rounds.record[:, 1].tolist()
    outputs = [[token] for token in first]
    done = [token in eos_ids or max_new_tokens == 1 for token in first]
    stats = [DSparkStats() for _ in outputs]
    for row in range(len(outputs)):
        if done[row]:
            rounds.active[row] = 0
    while not all(done):
        with rounds.tap if rounds.tap is not None else torch.no_grad():
            rounds.compiled()
        for row, (accepted, *tokens) in enumerate(rounds.record.tolist()):  # the round's one synchronisation
            if done[row]:
                continue
            emitted = tokens[: accepted + 1]
            end = next((i for i, token in enumerate(emitted) if token in eos_ids), len(emitted) - 1)
            emitted = emitted[: min(end + 1, max_new_tokens - len(outputs[row]))]
            outputs[row] += emitted
            stats[row].drafted.append(rounds.width - 1)
            stats[row].accepted.append(accepted)
            stats[row].committed.append(len(emitted))
            if emitted[-1] in eos_ids or len(outputs[row]) >= max_new_tokens:
                done[row] = True
                rounds.active[row] = 0
    if drafter is not None:
        drafter.generation_stats = BatchedDSparkStats(stats)
    return outputs
