"""Batched DSpark `generate()`: `target.generate(input_ids [B, L], attention_mask=..., assistant_model=drafter)`
for B > 1 (left padding), lossless per row, every row with its own verify length and accepted length per round.

transformers' `_assisted_decoding` is batch-1 only, so `hook.install()` routes B > 1 here (see `hook.py`): generate()
has already prepared the generation config, the logits processors and the stopping criteria, and we run our own
loop over `SpeculativeRows` (a padded batch whose rejected slots become masked cache holes).

Semantics follow plain batched `generate()`: logits processors see each row as plain batched decoding does (the
row's padded prompt followed by its own generated tokens), eos ends a row (it is kept, the rest is `pad_token_id`),
`max_new_tokens`/`max_length`, stop strings and custom stopping criteria end rows at the exact token. With float32
and no padding-sensitive processor, each row equals its solo `generate()`.
"""

from __future__ import annotations

import torch
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    PreTrainedModel,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..models import DSparkDraftModel
from ..verify import VerifyResult, verify
from .candidate_generator import DSparkStats
from .policy import resolve_policy
from .speculative_rows import Row, SpeculativeRows, ragged_drafts, ragged_rows
from .target_features import check_drafter_fits_target


# Processors that act on each row's scores alone (input ids unused): one call over any subset of rows.
ROW_WISE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                       TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper)


class ProcessorSampler:
    """Token choice with a transformers `LogitsProcessorList` (greedy argmax or multinomial sampling).

    Processors may keep per-row state for the batch generate() prepared (e.g. transformers 5.2x's repetition penalty
    skips each row's left padding by row index), so they are always called with the full original batch, row b at
    index b; rows of equal length share a call, the other rows are filler whose outputs are discarded."""

    def __init__(self, processors: LogitsProcessorList, do_sample: bool, padded_prompts: list[list[int]],
                 filler_id: int = 0):
        self.processors = processors
        self.do_sample = do_sample
        self.padded_prompts = padded_prompts  # row.tag -> its prompt as plain batched generate() pads it
        self.filler_id = filler_id
        self.row_wise = all(isinstance(p, ROW_WISE_PROCESSORS) for p in processors)

    def _ids(self, row: Row, extra: list[int]) -> list[int]:
        return self.padded_prompts[row.tag] + row.generated + extra

    def process(self, rows: list[Row], extras: list[list[int]], scores: torch.Tensor) -> torch.Tensor:
        """`processors(ids, scores)` with each row's own ids, as plain batched generate() calls them."""
        if len(self.processors) == 0 or not rows:
            return scores
        if self.row_wise:
            return self.processors(torch.zeros(len(rows), 1, dtype=torch.long, device=scores.device), scores.clone())
        sequences = [self._ids(row, extra) for row, extra in zip(rows, extras)]
        out = torch.empty_like(scores)
        groups: dict[int, list[int]] = {}
        for i, sequence in enumerate(sequences):
            groups.setdefault(len(sequence), []).append(i)
        batch = len(self.padded_prompts)
        for length, members in groups.items():
            ids = torch.full((batch, length), self.filler_id, dtype=torch.long)
            full_scores = scores.new_zeros(batch, scores.shape[-1])
            slots = torch.tensor([rows[i].tag for i in members])
            ids[slots] = torch.tensor([sequences[i] for i in members], dtype=torch.long)
            index = torch.tensor(members, device=scores.device)
            full_scores[slots.to(scores.device)] = scores[index]
            out[index] = self.processors(ids.to(scores.device), full_scores)[slots.to(scores.device)]
        return out

    def _choose(self, processed: torch.Tensor) -> torch.LongTensor:
        if self.do_sample:
            return torch.multinomial(processed.softmax(dim=-1), num_samples=1).squeeze(1)
        return processed.argmax(dim=-1)

    def select(self, rows, drafted, logits):
        processed = self.process(rows, drafted.tolist(), logits)
        return self._choose(processed), processed

    def first_tokens(self, rows, logits):
        return self._choose(self.process(rows, [[] for _ in rows], logits))

    def verify(self, rows, drafts, lengths, target_logits, draft_logits) -> VerifyResult:
        processed = target_logits
        if len(self.processors) > 0:
            processed = target_logits.clone()
            draft_lists = drafts.tolist()
            for j in range(target_logits.shape[1]):
                active = [r for r in range(len(rows)) if lengths[r] >= j]
                index = torch.tensor(active, device=target_logits.device)
                processed[index, j] = self.process([rows[r] for r in active], [draft_lists[r][:j] for r in active],
                                                   target_logits[index, j])
        flat_drafts = ragged_drafts(drafts, lengths)
        probs = None
        if self.do_sample:
            vocab = target_logits.shape[-1]
            probs = (ragged_drafts(draft_logits, lengths).softmax(dim=-1) if draft_logits is not None
                     else target_logits.new_zeros(0, vocab))
        return verify(flat_drafts, lengths.to(target_logits.device), ragged_rows(processed, lengths), probs,
                      do_sample=self.do_sample, temperature=1.0)


class BatchedDSparkStats:
    """What a batched `generate()` did: one `DSparkStats` per row (`rows[b]`), in input order."""

    def __init__(self, rows: list[DSparkStats]):
        self.rows = rows

    @property
    def rounds(self) -> int:
        return max((stats.rounds for stats in self.rows), default=0)

    @property
    def tau(self) -> float:
        committed = sum(sum(stats.committed) for stats in self.rows)
        return committed / max(1, sum(stats.rounds for stats in self.rows))


def _custom_criteria(stopping_criteria: StoppingCriteriaList | None) -> StoppingCriteriaList:
    """Criteria other than max length and eos (which rows track themselves): stop strings, user criteria."""
    return StoppingCriteriaList(
        [c for c in (stopping_criteria or []) if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    )


def stop_index(row: Row, start: int, criteria: StoppingCriteriaList, ids_of) -> int | None:
    """The index in `row.ids` (>= start) of the token that ends the row, or None. `ids_of(row, end)` gives the ids
    the criteria see for the prefix `row.ids[:end]`."""
    last = len(row.ids)
    for index in range(start, last):
        if row.ids[index] in row.stop_ids or index - row.prompt_len + 1 >= row.max_new:
            return index
        if len(criteria) and bool(criteria(ids_of(row, index + 1), None).any()):
            return index
    return None


def padding_token(generation_config: GenerationConfig) -> int:
    """The token plain batched `generate()` fills finished rows with: the pad token, else the (smallest) eos."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is not None:
        return int(pad.reshape(-1)[0])
    eos = getattr(generation_config, "_eos_token_tensor", None)
    return int(eos.reshape(-1).min()) if eos is not None and eos.numel() else 0


def append_rows(input_ids: torch.LongTensor, generated: list[list[int]], pad_id: int) -> torch.LongTensor:
    """The prompts [B, W] followed by each row's generated tokens, `pad_id` after a row's end (as plain batched
    `generate()` returns them)."""
    longest = max(map(len, generated))
    tail = torch.full((len(generated), longest), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    for row, tokens in enumerate(generated):
        tail[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, tail], dim=1)


def batched_generate(
    target: PreTrainedModel,
    drafter: DSparkDraftModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer=None,
    **model_kwargs,
):
    """The decoding method `generate()` calls for a DSpark drafter and batch size > 1 (same arguments as
    `GenerationMixin._assisted_decoding`)."""
    if streamer is not None:
        raise ValueError("Streamers take one sequence at a time; with batch size > 1 use dspark_hf.serving."
                         "DSparkEngine to stream each request, or call generate() per prompt.")
    if generation_config.return_dict_in_generate and any(
        getattr(generation_config, flag, False)
        for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
    ):
        raise ValueError("Batched DSpark generate() returns sequences only: drop output_scores/output_logits/"
                         "output_attentions/output_hidden_states, or call generate() per prompt.")
    if model_kwargs.get("synced_gpus"):
        raise ValueError("Batched DSpark generate() does not support synced_gpus.")
    check_drafter_fits_target(drafter.config, target)
    drafter.share_target_weights(target)
    policy = resolve_policy(generation_config, drafter)

    batch, width = input_ids.shape
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.bool()
    eos = getattr(generation_config, "_eos_token_tensor", None)
    stop_ids = frozenset(eos.reshape(-1).tolist()) if eos is not None else frozenset()
    pad_id = padding_token(generation_config)
    max_new = generation_config.max_length - width

    rows = []
    padded = input_ids.tolist()
    for b in range(batch):
        own = input_ids[b][attention_mask[b]].tolist()
        if not own:
            raise ValueError(f"Row {b} of the batch has an empty prompt (its attention_mask is all zeros).")
        rows.append(Row(ids=own, prompt_len=len(own), max_new=max_new, stop_ids=stop_ids, tag=b))
    sampler = ProcessorSampler(logits_processor, bool(generation_config.do_sample), padded, filler_id=pad_id)
    criteria = _custom_criteria(stopping_criteria)
    ids_of = lambda row, end: torch.tensor([padded[row.tag] + row.ids[row.prompt_len:end]], device=input_ids.device)

    runner = SpeculativeRows(target, drafter, sampler, policy, drafter.config.sts_temperatures)
    final: dict[int, list[int]] = {}

    def retire(starts: list[int]) -> None:
        done = []
        for row, start in zip(list(runner.rows), starts):
            end = stop_index(row, start, criteria, ids_of)
            if end is not None:
                del row.ids[end + 1:]
                final[row.tag] = row.generated
                done.append(row)
        runner.remove(done)

    if max_new <= 0:
        return input_ids
    runner.add(rows)
    retire([row.prompt_len for row in runner.rows])
    while runner.rows:
        starts = [len(row.ids) for row in runner.rows]
        runner.step()
        retire(starts)

    drafter.generation_stats = BatchedDSparkStats([
        DSparkStats(drafted=row.drafted, accepted=row.accepted, committed=[a + 1 for a in row.accepted]) for row in rows
    ])
    sequences = append_rows(input_ids, [final[b] for b in range(batch)], pad_id)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
