"""`StaticRows`: `DSparkEngine`'s rows on static caches (`DSparkEngine(..., static=True)`), greedy.

The same interface as `SpeculativeRows` (`rows`, `add`, `step`, `remove`), over a `StaticBatchRounds` of
`max_batch_size` rows: a request takes a free row (`StaticBatchRounds.admit`), every round drafts γ tokens for every
row and verifies all of them in one target forward (one CUDA graph with `compile=True`, one host read per round), and
a finished or cancelled request frees its row. Rows without a request keep computing until one takes them (their
results are dropped). Verify lengths are fixed (every draft), sampling is greedy, and there is no speculation guard:
the engine refuses what this runner does not do.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import PreTrainedModel

from ..models import DSparkDraftModel
from .profiling import RoundProfiler
from .speculative_rows import Row, left_padded
from .static_batch import StaticBatchRounds
from .static_loop import fast_kernels, kernel_choice, kernels_active


class StaticRows:
    """Rows of `DSparkEngine` on a `StaticBatchRounds` of `max_batch_size` rows and `max_model_len` positions.
    `drafter=None`: plain decoding rounds. `compile`, `attention`, `fuse_projections` as in `static_generate_batch`
    (`compile=True`: one CUDA graph per round)."""

    def __init__(self, target: PreTrainedModel, drafter: DSparkDraftModel | None, max_batch_size: int,
                 max_model_len: int, compile: bool | dict = False, attention: str = "auto",
                 fuse_projections: bool | None = None):
        span = 1 if drafter is None else drafter.config.num_draft_slots + 1  # tokens a round runs per row
        self.span, self.batch_size = span, max_batch_size
        capacity = max_model_len + 2 * span  # a short prompt's left padding, a round's overshoot past max_tokens
        build = lambda: StaticBatchRounds(target, drafter, max_batch_size, capacity, compile)  # noqa: E731
        with fast_kernels(target, drafter, attention, fuse_projections, build) as rounds:
            self.rounds = rounds
        kernel, fuse = kernel_choice(target, attention, fuse_projections)
        self._kernels = lambda: kernels_active(target, drafter, kernel, fuse)  # per call: the models are shared
        self.owner: list[Row | None] = [None] * max_batch_size  # each row's request
        self.started = False
        self.drafted_last_round = drafter is not None
        self.profiler: RoundProfiler | None = None
        self.guard = None

    @property
    def rows(self) -> list[Row]:
        return [row for row in self.owner if row is not None]

    @property
    def state(self) -> StaticRows:  # the engine's round log reads `state.width` and `state.hole_fraction()`
        return self

    @property
    def width(self) -> int:
        return self.rounds.capacity

    def hole_fraction(self) -> float:
        """The share of the cache's columns that no request's tokens fill."""
        used = sum(len(row.ids) for row in self.rows)
        return 1.0 - used / (self.batch_size * self.rounds.capacity)

    def _groups(self, rows: list[Row]) -> list[list[Row]]:
        """`rows` in groups that one left-padded prefill can take: padded to its longest prompt (at least γ + 2, a
        drafter's first context), every row of a group must still fit its budget and a round's overshoot."""
        groups: list[list[Row]] = []
        for row in sorted(rows, key=lambda row: -len(row.ids)):
            if groups:
                width = max(len(groups[-1][0].ids), self.span + 1)
                if width + row.max_new + self.span <= self.rounds.capacity:
                    groups[-1].append(row)
                    continue
            groups.append([row])
        return groups

    @torch.no_grad()
    def add(self, rows: list[Row]) -> list[list[int]]:
        """Gives each of `rows` a free row (one prefill per group of similar lengths); returns the one token each
        committed, in `rows` order."""
        free = [index for index, owner in enumerate(self.owner) if owner is None]
        if len(free) < len(rows):
            raise RuntimeError(f"{len(rows)} requests for {len(free)} free rows.")
        rounds, first = self.rounds, {}
        with self._kernels(), self._part("prefill"):
            for group in self._groups(rows):
                ids, mask = left_padded(group, min_width=self.span + 1)  # γ + 2: a drafter's first context
                mask = mask.long()
                slots, free = free[: len(group)], free[len(group):]
                if not self.started:  # the first prefill sets up every row; rows without a request stop at once
                    spare = [0] * (self.batch_size - len(group))
                    rounds.prefill(torch.cat([ids, ids[spare]]), torch.cat([mask, mask[spare]]))
                    rounds.active[len(group):] = 0
                    self.started = True
                else:
                    rounds.admit(slots, ids, mask)
                for slot, row, token in zip(slots, group, rounds.record[slots, 1].tolist()):
                    self.owner[slot] = row
                    first[id(row)] = token
        for row in rows:
            row.ids.append(first[id(row)])
        return [[first[id(row)]] for row in rows]

    def remove(self, rows: list[Row]) -> None:
        """Frees the rows of finished or cancelled requests."""
        gone = {id(row) for row in rows}
        for index, owner in enumerate(self.owner):
            if owner is not None and id(owner) in gone:
                self.owner[index] = None
                self.rounds.active[index] = 0

    @torch.no_grad()
    def step(self) -> list[list[int]]:
        """One round for every row; returns the tokens each request's row committed, in `rows` order."""
        rounds = self.rounds
        with self._kernels(), self._part("verify_forward"):  # (the whole round: one graph)
            with rounds.tap if rounds.tap is not None else nullcontext():
                rounds.compiled()
            record = rounds.record.tolist()  # the round's one synchronisation
        committed = []
        for index, row in enumerate(self.owner):
            if row is None:
                continue
            accepted, *tokens = record[index]
            row.ids.extend(tokens[: accepted + 1])
            row.drafted.append(self.span - 1)
            row.accepted.append(accepted)
            committed.append(tokens[: accepted + 1])
        return committed

    def _part(self, name: str):
        return self.profiler.part(name) if self.profiler is not None else nullcontext()
