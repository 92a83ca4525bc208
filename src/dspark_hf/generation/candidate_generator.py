"""`DSparkCandidateGenerator`: DSpark drafting inside transformers' own assisted-decoding loop (batch 1).

transformers verifies the candidates (greedy match or `_speculative_sampling`); we hand it, per drafted token, the
processed float32 logits the token was drawn from, so sampling stays exactly the target's distribution. The target's
hidden states come from a `TargetLayerTap` that is active around the target's forwards (`hook.py` opens it for the
whole `generate()` call).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import CandidateGenerator, LogitsProcessorList
from transformers.generation.stopping_criteria import StopStringCriteria

from ..models import DSparkDraftModel, TargetLayerTap
from .policy import VerifyLengthChooser, resolve_max_drafts, resolve_policy
from .target_features import check_drafter_fits_target


@dataclass
class DSparkStats:
    """What one `generate()` call did, round by round (read it from `drafter.generation_stats`).

    `drafted[i]` tokens proposed for verification in round i, `accepted[i]` how many of them were accepted,
    `committed[i]` tokens the round added (accepted drafts + bonus/correction; no bonus after an accepted eos),
    `confidence_logits[i]` the raw confidence logits of the proposed slots, `draft_seconds[i]` drafting time and
    `verify_seconds[i]` the time from handing the candidates over to the next call (target forward, acceptance,
    bookkeeping). The prefill round is not counted.
    """

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    confidence_logits: list[torch.Tensor] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.committed)

    @property
    def tau(self) -> float:
        """Mean accepted length per round, bonus included (DeepSpec's τ)."""
        return sum(self.committed) / max(1, self.rounds)

    def acceptance_by_position(self) -> list[float]:
        """accept_rate@k: fraction of rounds with > k drafted tokens in which draft k+1 was accepted."""
        gamma = max(self.drafted, default=0)
        rates = []
        for k in range(gamma):
            proposed = [a for d, a in zip(self.drafted, self.accepted) if d > k]
            rates.append(sum(a > k for a in proposed) / len(proposed) if proposed else float("nan"))
        return rates


class DSparkCandidateGenerator(CandidateGenerator):
    """Proposes DSpark blocks from the target's hidden states, read by `tap` (which must be active around the target's
    forwards; a new, inactive one when not given). A forward may start before the drafter's context ends (a loop that
    re-feeds tokens): features are located from the end of the last forward, which covered the candidates of the
    last call."""

    requires_model_outputs = True

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DSparkDraftModel,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList,
        tokenizer=None,
        tap: TargetLayerTap | None = None,
    ):
        check_drafter_fits_target(drafter.config, target)
        drafter.share_target_weights(target)
        self.target = target
        self.drafter = drafter
        self.logits_processor = logits_processor
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        eos = getattr(generation_config, "_eos_token_tensor", None)  # set by generate(); plain configs lack it
        if eos is None and generation_config.eos_token_id is not None:
            eos = torch.tensor(generation_config.eos_token_id)
        self.eos_token_ids = eos.reshape(-1).to(target.device) if eos is not None else None
        self.stop_strings = (
            StopStringCriteria(tokenizer=tokenizer, stop_strings=generation_config.stop_strings)
            if generation_config.stop_strings is not None and tokenizer is not None
            else None
        )
        self.verify_length = VerifyLengthChooser(resolve_policy(generation_config, drafter),
                                                 drafter.config.sts_temperatures,
                                                 resolve_max_drafts(generation_config, drafter))
        self.tap = tap if tap is not None else TargetLayerTap(target, drafter.config.target_layer_ids)
        self.model_kwargs_overrides = {}
        self.cache = DynamicCache()
        self.context_length = 0  # target positions whose features are in the drafter cache
        self.stats = DSparkStats()
        drafter.generation_stats = self.stats
        self._handed_over_at: float | None = None
        self._length_before_verify: int | None = None  # None: the last forward was the prefill
        self._verified_drafts: torch.LongTensor | None = None
        self._forward_end = 0  # sequence length after the target's last forward (the candidates last handed over)

    @property
    def num_drafting_tokens(self) -> int:
        """At most this many drafts per round (transformers >= 5.25 keeps as many recurrent / sliding-window states to
        roll back after verification)."""
        return self.drafter.config.block_size

    # transformers calls this with keyword arguments (see `_assisted_decoding`).
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        max_drafts: int | None = None,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Candidates `[input_ids, drafts]` and the processed logits each draft was drawn from. `max_drafts` caps the
        verify length (our own loops pass it; transformers' loop does not)."""
        first = is_first_iteration or model_outputs is None
        if first and not self._ends_with_stop(input_ids):
            self._forward_end = input_ids.shape[1]
            return input_ids, None  # the target prefills first; its hidden states arrive with the next call
        started = time.perf_counter()
        if self._handed_over_at is not None:
            self.stats.verify_seconds.append(started - self._handed_over_at)

        anchor_position = input_ids.shape[1] - 1
        device = self.drafter.device
        if first:
            # The prompt ends in eos: transformers' loop treats an empty candidate there as finished and emits
            # nothing, so draft from no target features (verification keeps the output exact).
            features = torch.zeros(1, 0, self.drafter.fc.in_features, device=device, dtype=self.drafter.dtype)
            context_positions = torch.arange(0, device=device)[None]
        else:
            features = self.tap.features(device)
            start = self.context_length - (self._forward_end - features.shape[1])
            features = features[:, start : start + anchor_position - self.context_length]
            context_positions = torch.arange(self.context_length, anchor_position, device=device)[None]
            self.context_length = anchor_position
        block_positions = torch.arange(anchor_position, anchor_position + self.drafter.config.block_size, device=device)

        budget = self.max_length - input_ids.shape[1] - 1
        proposal = self.drafter.draft(
            input_ids[:, -1].to(device),
            features,
            self.cache,
            position_ids=block_positions[None],
            context_position_ids=context_positions,
            num_tokens=max(budget, 1),
            select=self._selector(input_ids),
        )
        tokens = proposal.tokens.to(input_ids.device)
        if first:  # never an empty candidate here (see above)
            num_tokens = max(self._stop_length(input_ids, tokens), 1)
        else:
            available = self._stop_length(input_ids, tokens) if budget > 0 else 0
            num_tokens = self.verify_length(proposal.confidence_logits,
                                            available if max_drafts is None else min(available, max_drafts))

        self.stats.draft_seconds.append(time.perf_counter() - started)
        self._handed_over_at = time.perf_counter()
        self._length_before_verify = input_ids.shape[1]
        self._verified_drafts = tokens[0, :num_tokens]
        self._forward_end = input_ids.shape[1] + num_tokens
        self.stats.drafted.append(num_tokens)
        confidence = proposal.confidence_logits
        self.stats.confidence_logits.append(confidence[0, :num_tokens].cpu() if confidence is not None else torch.empty(0))
        if num_tokens == 0:
            return input_ids, None
        candidates = torch.cat([input_ids, tokens[:, :num_tokens]], dim=1)
        return candidates, proposal.logits[:, :num_tokens].to(input_ids.device)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        if self._length_before_verify is not None:
            new_tokens = input_ids[0, self._length_before_verify:]
            drafts = self._verified_drafts
            # Accepted drafts = common prefix of drafts and committed tokens (a correction never equals the rejected
            # draft: greedy picks another argmax, and the residual max(p - q, 0) is 0 at a rejected token).
            common = new_tokens[: drafts.numel()] == drafts[: new_tokens.numel()]
            self.stats.accepted.append(int(common.long().cumprod(0).sum()))
            self.stats.committed.append(new_tokens.numel())

    # ------------------------------------------------------------------ helpers
    def _selector(self, prefix: torch.LongTensor):
        """Slot-wise token choice with the target's logits processors, on the growing candidate prefix."""
        processors, do_sample = self.logits_processor, self.do_sample

        def select(drafted: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
            processed = logits
            if len(processors) > 0:
                ids = torch.cat([prefix, drafted.to(prefix.device)], dim=1)
                processed = processors(ids, logits.clone().to(prefix.device)).to(logits.device)
            if do_sample:
                token = torch.multinomial(processed.softmax(dim=-1), num_samples=1).squeeze(1)
            else:
                token = processed.argmax(dim=-1)
            return token, processed

        return select

    def _ends_with_stop(self, input_ids: torch.LongTensor) -> bool:
        """Whether the sequence already ends with an eos token or a stop string."""
        if self.eos_token_ids is not None and bool(torch.isin(input_ids[0, -1], self.eos_token_ids)):
            return True
        return self.stop_strings is not None and bool(self.stop_strings(input_ids, None).any())

    def _stop_length(self, input_ids: torch.LongTensor, tokens: torch.LongTensor) -> int:
        """Drafts to verify so that a round never runs past where plain decoding stops.

        Up to and including the first eos (transformers cuts accepted tokens there). For stop strings, transformers
        only looks at the sequence after a round (5.24 also appends the bonus token after a fully accepted draft), so
        drafts stop *before* the token that would complete one: the target's own next token then completes it and
        generation ends at the same token as plain decoding.
        """
        length = tokens.shape[1]
        if self.eos_token_ids is not None:
            hits = torch.isin(tokens[0], self.eos_token_ids).nonzero()
            if hits.numel():
                length = int(hits[0, 0]) + 1
        if self.stop_strings is not None:
            for end in range(1, length + 1):
                if bool(self.stop_strings(torch.cat([input_ids, tokens[:, :end]], dim=1), None).any()):
                    return end - 1
        return length
