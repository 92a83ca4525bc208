"""Admitting requests into a running `StaticBatchRounds` in fixed-size chunks, each chunk one graph.

`StaticBatchRounds.admit` prefills new prompts with an eager forward of the target (and one of the drafter) on
temporary caches. On a GPU an eager forward of a small model is bound by kernel launches: on the H200 the 50M
fixture's admission cost about 10 ms per request without a drafter and 16 ms with one, against 1-2 ms for a
compiled round, so at 16 concurrent requests admissions took about two thirds of the serving time
(`benchmarks/results/serving_static_eager_admission_h200.json`).

`ChunkedAdmission` runs the prompts instead as ⌈W / chunk⌉ forwards of `chunk` tokens on a copy of the rounds'
caches with `rows` rows (the target's, and the drafter's context), every chunk the same function of the same shapes,
so with `compile` it is one CUDA graph whatever the prompts' lengths. Up to `rows` prompts join at once, each
left-padded to the longest's multiple of `chunk` (the scratch rows no prompt takes repeat the first one); their K/V
then go into the admitted rows of the running batch (W columns per layer) and their state is set as `admit` sets it
(`StaticBatchRounds.start_rows`). Each chunk's queries see the columns before them (causal), so the caches equal those
of one forward over the prompt up to the kernels' rounding. A small model's chunk is bound by kernel launches, so a
chunk of several rows costs about what one row's does. `admit(..., prompt_context=False)` runs a second graph, without
the drafter and without the target's features, as admitting without a drafter runs: the rows join without their
prompt's drafter context (`StaticRows` does so while it runs bare plain rounds) and need
`StaticBatchRounds.catch_up()` before their first drafting round.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..tensor_ops import argmax_last, to_device
from .static_batch import StaticBatchRounds, write_rows


class ChunkedAdmission:
    """Prefills up to `rows` prompts at a time into rows of `rounds` (already running: after `prefill`) by
    `chunk`-token forwards on a `StaticBatchRounds` of `rows` rows and the same capacity and compile options. Prompts
    whose longest has L tokens take `padded_width(L)` columns of their rows."""

    def __init__(self, rounds: StaticBatchRounds, chunk: int = 64, rows: int = 1):
        if chunk < rounds.width:
            raise ValueError(f"chunk must hold a round's {rounds.width} tokens (γ + 1), got {chunk}.")
        if not 1 <= rows <= rounds.pad.shape[0]:
            raise ValueError(f"rows must lie in 1..{rounds.pad.shape[0]} (the batch's rows), got {rows}.")
        self.rounds, self.chunk, self.rows = rounds, chunk, rows
        self.scratch = StaticBatchRounds(rounds.target, rounds.drafter, rows, rounds.capacity, rounds.compile,
                                         kernels=rounds.kernels)
        device = rounds.anchor.device
        self.ids = torch.zeros(rows, chunk, dtype=torch.long, device=device)  # the chunk's tokens
        self.first_column = torch.zeros(rows, dtype=torch.long, device=device)  # its first column
        self.last_logits: torch.Tensor | None = None  # [rows, V]: the last chunk's last logits (float32)
        self.tail: torch.Tensor | None = None  # [rows, γ + 1, K·H]: the last chunk's last γ + 1 target features
        if rounds.compile:
            for buffer in (self.ids, self.first_column):
                torch._dynamo.mark_static_address(buffer)
        self.compiled_chunk = self.scratch._compiled(self._chunk_forward)
        # the chunk without the drafter: no context forward, no features (outside the tap)
        self.compiled_chunk_without_context = self.scratch._compiled(
            functools.partial(self._chunk_forward, prompt_context=False), tapped=False)

    def padded_width(self, prompt_length: int) -> int:
        """Columns a prompt of `prompt_length` tokens takes: at least 2 (γ + 1) (what `StaticBatchRounds.catch_up`
        reads), rounded up to a multiple of `chunk`."""
        return -(-max(prompt_length, self.rounds.catch_up_tokens) // self.chunk) * self.chunk

    def _chunk_forward(self, prompt_context: bool = True) -> None:
        """The target over `ids` at columns `first_column` .. + chunk - 1 of the one-row caches (with
        `prompt_context` and a drafter, the drafter's context K/V of those columns too, and its features into
        `tail`); its last logits into `last_logits`."""
        scratch = self.scratch
        logits, features = scratch._target_forward(self.ids, self.first_column, logits_to_keep=1,
                                                   tapped=prompt_context)
        self.last_logits.copy_(logits[:, -1])
        if features is not None:
            scratch._write_drafter_context(features, self.first_column, self.first_column + self.chunk)
            self.tail.copy_(features[:, -scratch.width:])

    def _allocate(self) -> None:
        """The output buffers, shaped by an eager target forward (the vocabulary and the feature width), then one
        eager chunk, so that the caches' lazy initialisation happens outside any graph."""
        scratch = self.scratch
        with scratch._running():
            logits, features = scratch._target_forward(self.ids, self.first_column, logits_to_keep=1)
            self.last_logits = logits[:, -1].clone()
            if features is not None:
                self.tail = features[:, -scratch.width:].clone()
            if scratch.compile:
                for buffer in (self.last_logits, self.tail):
                    if buffer is not None:
                        torch._dynamo.mark_static_address(buffer)
            self._chunk_forward()

    def prefill(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor, prompt_context: bool = True) -> int:
        """Runs up to `rows` left-padded prompts [k, L] (`attention_mask` [k, L]: 0 on padding) through the scratch
        caches in chunks, row i the i-th (the rows no prompt takes repeat the first); returns their padded width W."""
        count = input_ids.shape[0]
        if not 1 <= count <= self.rows:
            raise ValueError(f"{count} prompts for an admission of at most {self.rows} rows.")
        scratch = self.scratch
        spare = [0] * (self.rows - count)
        real = torch.cat([attention_mask, attention_mask[spare]]).sum(dim=1)
        length = int(real.max())  # (columns that are padding in every row are dropped)
        width = self.padded_width(length)
        kept = torch.cat([input_ids, input_ids[spare]])[:, input_ids.shape[1] - length:]
        padded = torch.nn.functional.pad(kept, (width - length, 0)).to(self.ids.device)
        scratch.pad.copy_(width - real)
        if self.last_logits is None:
            self._allocate()
        skip_drafter = not prompt_context and scratch.drafter is not None  # (else: the one graph `warm_up` captures)
        chunk = self.compiled_chunk_without_context if skip_drafter else self.compiled_chunk
        for start in range(0, width, self.chunk):  # (the compiled chunk runs its Python with the tap active)
            self.ids.copy_(padded[:, start: start + self.chunk])
            self.first_column.fill_(start)
            chunk()
        return width

    @torch.no_grad()
    def admit(self, slots: list[int], input_ids: torch.LongTensor, attention_mask: torch.Tensor,
              choose: Callable[[torch.Tensor], torch.LongTensor] = argmax_last, prompt_context: bool = True) -> None:
        """Prefills the left-padded prompts [k, L] (up to `rows` of them; `attention_mask` 0 on padding) into rows
        `slots` of `rounds` (which have stopped; the others keep their state), as `StaticBatchRounds.admit` does;
        `choose` picks their first tokens from the last logits [k, V] (into `record`)."""
        rounds, scratch, count = self.rounds, self.scratch, len(slots)
        if not rounds.target_cache.layers[0].is_initialized:
            raise RuntimeError("admit() refills rows of a running batch: call prefill() first.")
        if count != input_ids.shape[0]:
            raise ValueError(f"{count} slots for {input_ids.shape[0]} prompts.")
        width = self.prefill(input_ids, attention_mask, prompt_context)
        index = to_device(slots, rounds.anchor.device, torch.long)
        write_rows(rounds.target_cache, scratch.target_cache, index, width)
        if rounds.drafter is not None and prompt_context:
            write_rows(rounds.drafter_cache, scratch.drafter_cache, index, width)
        tail = self.tail[:count] if self.tail is not None and prompt_context else None
        rounds.start_rows(index, scratch.pad[:count], choose(self.last_logits[:count]), width, tail)
