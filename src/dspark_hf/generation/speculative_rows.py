"""One DSpark round for many rows at once: batched drafting, per-row verify lengths, one target forward, ragged
lossless verification, per-row commit. Shared by batched `generate()` and `dspark_hf.serving.DSparkEngine`.

A round, for rows r = 1..B with anchors a_r (the last committed token, not yet in the target cache):

1. the drafter proposes k tokens per row from the pending target features (masked padded batch, one forward);
2. the policy picks l_r <= available_r drafts per row (`available` = budget and the first stop token);
3. the target runs once on `[a_r, d_r1 .. d_rL]` (L = max l_r) over the shared cache with per-row holes masked;
4. `dspark_hf.verify.verify` accepts n_r <= l_r drafts per row and emits one more token (residual or bonus);
5. columns a_r, d_r1..d_rn_r become valid, the others holes; their target features become pending for the drafter.

How tokens are chosen (logits processors of `generate()`, or per-request temperature/top-k/top-p of the engine)
is a `RowSampler`. Every draft slot's q is exactly the distribution its token was drawn from, so verification is
lossless per row.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..calibration import apply_sts
from ..models import DSparkDraftModel, TargetLayerTap
from ..scheduling import SchedulerPolicy, SpeculationGuard
from ..verify import VerifyResult
from .profiling import RoundProfiler
from .ragged import RaggedBatch
from .target_features import target_is_stateful


@dataclass
class Row:
    """One sequence. `ids`: its prompt and every committed token (no padding). `pad`: left padding it has in the
    layout that logits processors see (that of plain batched `generate()`; 0 in the engine). `max_new`: tokens it
    may still commit in total. `stop_ids`: token ids that end it (included in the output)."""

    ids: list[int]
    prompt_len: int
    max_new: int
    stop_ids: frozenset[int] = frozenset()
    pad: int = 0
    tag: Any = None
    drafted: list[int] = field(default_factory=list)  # per round: drafts sent to verification
    accepted: list[int] = field(default_factory=list)  # per round: drafts accepted

    @property
    def generated(self) -> list[int]:
        return self.ids[self.prompt_len:]

    @property
    def remaining(self) -> int:
        return self.max_new - (len(self.ids) - self.prompt_len)


def left_padded(rows: list[Row], min_width: int = 0) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """The rows' token ids left-padded to their longest (at least `min_width`): ids [R, W] (0 on padding) and the
    mask of real tokens [R, W]."""
    width = max(min_width, *(len(row.ids) for row in rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for index, row in enumerate(rows):
        ids[index, width - len(row.ids):] = torch.tensor(row.ids)
        mask[index, width - len(row.ids):] = True
    return ids, mask


class RowSampler(Protocol):
    """How rows choose tokens. `select` draws draft slot tokens and returns the processed logits they were drawn from;
    `first_tokens` picks the token after a prompt; `verify` runs lossless verification of a ragged round."""

    def select(self, rows: list[Row], drafted: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def first_tokens(self, rows: list[Row], logits: torch.Tensor) -> torch.LongTensor: ...

    def verify(self, rows: list[Row], drafts: torch.LongTensor, lengths: torch.LongTensor, target_logits: torch.Tensor,
               draft_logits: torch.Tensor) -> VerifyResult: ...


def check_batchable_target(target: PreTrainedModel) -> None:
    """Per-row cache holes need full attention on every target layer (sliding windows count columns, not tokens) and
    a cache that can be cut back (not a stateful target's)."""
    if target_is_stateful(target):
        raise ValueError(f"Batched DSpark decoding needs a target whose cache can be cut back after rejected drafts; "
                         f"{type(target).__name__} is stateful. Call generate() per prompt (batch size 1) for it.")
    text = target.config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        others = sorted(set(layer_types) - {"full_attention"})
        if others:
            raise ValueError(f"Batched DSpark decoding supports full-attention targets; {type(target).__name__} has "
                             f"{others} layers. Call generate() per prompt (batch size 1) for this model.")
    elif getattr(text, "sliding_window", None) is not None:
        raise ValueError(f"Batched DSpark decoding supports full-attention targets; {type(target).__name__} uses a "
                         "sliding window. Call generate() per prompt (batch size 1) for this model.")
    implementation = str(getattr(target.config, "_attn_implementation", "") or "")
    if implementation.startswith("flash"):
        raise ValueError(f"Batched DSpark decoding masks per-row cache holes, which attn_implementation="
                         f"{implementation!r} (unpadded varlen attention) does not support; load the target with "
                         "attn_implementation='sdpa' (or 'eager'/'flex_attention').")
    if getattr(target.config, "is_encoder_decoder", False):
        raise ValueError("Batched DSpark decoding supports decoder-only targets.")


class SpeculativeRows:
    """Drives a `RaggedBatch` of `Row`s: prefill, rounds, merges and removals. `drafter=None` or `speculate=False`
    gives plain batched decoding through the same code (the no-speculation baseline)."""

    def __init__(self, target: PreTrainedModel, drafter: DSparkDraftModel | None, sampler: RowSampler,
                 policy: SchedulerPolicy | None = None, sts_temperatures=None, compact_threshold: float = 0.5,
                 guard: SpeculationGuard | None = None):
        check_batchable_target(target)
        self.target, self.drafter, self.sampler = target, drafter, sampler
        self.policy, self.sts_temperatures, self.guard = policy, sts_temperatures, guard
        self.compact_threshold = compact_threshold
        self.speculate = drafter is not None
        self.rows: list[Row] = []
        self.state: RaggedBatch | None = None
        self.tap = TargetLayerTap(target, drafter.config.target_layer_ids) if drafter is not None else None
        self.confidence_history: list[torch.Tensor] = []  # the asynchronous policy reads confidences 2 rounds old
        self.drafted_last_round = False
        self.device = target.device
        self.profiler: RoundProfiler | None = None  # set to time each round's parts

    def _part(self, name: str):
        return self.profiler.part(name) if self.profiler is not None else nullcontext()

    # ------------------------------------------------------------------ forward helpers
    def _target_forward(self, ids, mask, positions, cache, keep_last_only: bool = False):
        kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        if keep_last_only:
            kwargs["logits_to_keep"] = 1
        if not self.speculate:
            return self.target(**kwargs).logits.float(), None
        with self.tap:
            logits = self.target(**kwargs).logits.float()
            return logits, self.tap.features(self.drafter.device)  # each tapped layer moves only if on another device

    # ------------------------------------------------------------------ admission
    @torch.no_grad()
    def add(self, rows: list[Row]) -> list[list[int]]:
        """Prefills `rows` (one left-padded forward), picks each one's first token and joins them to the batch.
        Returns the tokens committed per new row (one each)."""
        if not rows:
            return []
        with self._part("prefill"):
            return self._add(rows)

    def _add(self, rows: list[Row]) -> list[list[int]]:
        ids, mask = left_padded(rows)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits, features = self._target_forward(ids, mask.long(), positions, cache, keep_last_only=True)
        first = self.sampler.first_tokens(rows, logits[:, -1])
        state = RaggedBatch(
            target_cache=cache, drafter_cache=DynamicCache(), valid=mask,
            next_pos=mask.sum(dim=1), anchor=first, pending_features=features, pending_positions=positions,
        )
        committed = []
        for row, token in zip(rows, first.tolist()):
            row.ids.append(token)
            committed.append([token])
        if not self.speculate:
            state.take_pending()
        if self.state is None:
            self.state, self.rows = state, list(rows)
        else:
            self.state, self.rows = RaggedBatch.concat(self.state, state), self.rows + list(rows)
        return committed

    def remove(self, rows: list[Row]) -> None:
        """Drops finished or cancelled rows (their cache columns go with them)."""
        gone = {id(row) for row in rows}
        keep = [i for i, row in enumerate(self.rows) if id(row) not in gone]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.state = None
        else:
            self.state.select(keep)

    # ------------------------------------------------------------------ one round
    def _available(self, tokens: torch.LongTensor) -> torch.LongTensor:
        """Drafts each row may verify: its remaining budget (one token is always emitted) and up to its first stop."""
        counts = []
        drafted = tokens.tolist()
        for row, row_tokens in zip(self.rows, drafted):
            limit = min(len(row_tokens), max(row.remaining - 1, 0))
            for j in range(limit):
                if row_tokens[j] in row.stop_ids:
                    limit = j + 1
                    break
            counts.append(limit)
        return torch.tensor(counts, dtype=torch.long)

    def _draft(self) -> tuple[torch.LongTensor, torch.Tensor, torch.Tensor | None] | None:
        state, drafter = self.state, self.drafter
        budget = max(row.remaining - 1 for row in self.rows)
        if budget <= 0:
            return None
        gamma = drafter.config.block_size
        features, context_positions = state.take_pending()
        device = drafter.device
        if features is None:
            features = torch.zeros(state.size, 0, drafter.fc.in_features, dtype=drafter.dtype, device=device)
        blocked = torch.zeros(state.size, 1, gamma, state.width + gamma, dtype=drafter.dtype, device=device)
        blocked[:, :, :, : state.width].masked_fill_(~state.valid.to(device)[:, None, None, :],
                                                     torch.finfo(drafter.dtype).min)
        block_positions = state.next_pos.to(device)[:, None] + torch.arange(gamma, device=device)
        rows, sampler = self.rows, self.sampler
        arguments = dict(
            position_ids=block_positions, context_position_ids=context_positions.to(device), num_tokens=budget,
            select=lambda drafted, logits: sampler.select(rows, drafted, logits),
        )
        proposal = drafter.draft(state.anchor.to(device), features.to(device), state.drafter_cache,
                                 attention_mask=blocked, **arguments)
        return proposal.tokens, proposal.logits, proposal.confidence_logits

    def _verify_lengths(self, available: torch.LongTensor, confidence_logits: torch.Tensor | None) -> torch.LongTensor:
        if self.policy is None:
            return available
        if confidence_logits is None:  # a DFlash drafter: only a fixed length is possible (checked by the callers)
            conf = torch.ones(available.shape[0], int(available.max()) if available.numel() else 0)
        else:  # the policy runs on the host: dozens of ops on [R, γ] numbers, each a launch and some a sync on a GPU
            conf = apply_sts(confidence_logits.float().cpu(), self.sts_temperatures)
        stale = self.confidence_history[0] if len(self.confidence_history) == 2 else None
        self.confidence_history = (self.confidence_history + [conf])[-2:]
        lengths = self.policy(conf, max_lengths=available.to(conf.device), conf_stale=stale)
        return torch.minimum(lengths.cpu().long(), available)

    @torch.no_grad()
    def step(self) -> list[list[int]]:
        """One round for every row; returns the tokens each row committed (accepted drafts + one more)."""
        state, rows = self.state, self.rows
        drafts = None
        started = time.perf_counter()
        drafted_before = self.drafted_last_round
        draft_now = self.speculate and (self.guard is None or self.guard.should_draft(state.size))
        self.drafted_last_round = draft_now
        if draft_now:
            with self.profiler.drafting(self.drafter) if self.profiler is not None else nullcontext():
                drafted = self._draft()
            if drafted is not None:
                tokens, draft_logits, confidence = drafted
                with self._part("scheduler"):
                    available = self._available(tokens)
                    lengths = self._verify_lengths(available, confidence)
                longest = int(lengths.max())
                drafts = tokens[:, :longest].to(self.device)
                draft_logits = draft_logits[:, :longest]
            if state.pending == 0 and state.hole_fraction() > self.compact_threshold:
                state.compact()
        verify_started = time.perf_counter()  # the lengths came back from the device: drafting has finished
        drafter_ran = drafts is not None
        if drafts is None:
            lengths = torch.zeros(state.size, dtype=torch.long)
            drafts = torch.zeros(state.size, 0, dtype=torch.long, device=self.device)
            draft_logits = None
        span = drafts.shape[1] + 1
        ids = torch.cat([state.anchor.to(self.device)[:, None], drafts], dim=1)
        positions = state.next_pos.to(self.device)[:, None] + torch.arange(span, device=self.device)
        mask = torch.cat([state.valid, torch.ones(state.size, span, dtype=torch.bool, device=state.valid.device)], 1)
        with self._part("verify_forward"):
            logits, features = self._target_forward(ids, mask.long(), positions, state.target_cache)
        with self._part("verification"):
            result = self.sampler.verify(rows, drafts, lengths, logits, draft_logits)
        accepted = result.num_accepted.to(self.device)
        emitted = result.output_tokens.to(self.device)
        rows_index = torch.arange(state.size, device=self.device)
        state.append_columns(torch.arange(span, device=self.device)[None, :] <= accepted[:, None], features, positions)
        if not self.speculate:
            state.take_pending()
        state.next_pos = state.next_pos + accepted.to(state.next_pos.device) + 1
        state.anchor = emitted[rows_index, accepted]
        committed = []
        for row, n, out, length in zip(rows, accepted.tolist(), emitted.tolist(), lengths.tolist()):
            row.ids.extend(out[: n + 1])
            row.drafted.append(length)
            row.accepted.append(n)
            committed.append(out[: n + 1])
        if self.guard is not None and drafter_ran:  # the .tolist() above waited for the device: times are real
            finished = time.perf_counter()
            self.guard.record(len(rows), finished - started, finished - verify_started, state.size * span,
                              sum(map(len, committed)), catch_up=not drafted_before)
        return committed


def ragged_rows(logits: torch.Tensor, lengths: torch.LongTensor) -> torch.Tensor:
    """[B, 1 + L, ...] -> the first `lengths[r] + 1` entries of each row, flattened in row order."""
    span = logits.shape[1]
    keep = torch.arange(span)[None, :] <= lengths[:, None]
    return logits[keep.to(logits.device)]


def ragged_drafts(drafts: torch.Tensor, lengths: torch.LongTensor) -> torch.Tensor:
    """[B, L, ...] -> the first `lengths[r]` entries of each row, flattened in row order."""
    keep = torch.arange(drafts.shape[1])[None, :] < lengths[:, None]
    return drafts[keep.to(drafts.device)]
