"""Batch-1 decoding on static KV caches, one fixed-shape function per round: the fast path (experimental).

`static_generate(target, drafter, input_ids, max_new_tokens)` decodes like `generate(assistant_model=drafter)` at
batch 1 with a fixed verify length, but every round is the same function of the same shapes, touching no new memory:

- the target and the drafter each keep a transformers `StaticCache` sized for the whole generation;
- a round drafts from the previous round's γ + 1 target features (only the accepted ones are context: an attention
  mask hides the drafter-cache rows past the anchor, and the next round overwrites them), runs the Markov loop
  (greedy argmax, or an exponential race on noise drawn before the round, so sampling needs no generator inside),
  then the target's forward over `[anchor, γ drafts]` and, greedy, the acceptance;
- rejected tokens are rolled back by moving each cache's write position back, inside the round;
- compiled, a prompt of up to 512 tokens goes in as 64-token chunks, each a replay of one graph (target forward and
  the drafter's context), not as one eager forward, whose kernel launches cost a small model more than its compute;
- greedy decoding keeps the next round's anchor, positions and features, and a record of every round, in device
  buffers: the host queues as many rounds as cannot overshoot `max_new_tokens` and reads their records in one
  synchronisation; sampling verifies through `dspark_hf.verify` after each round, one synchronisation per round.

`compile=True` compiles the round function with `torch.compile` and captures drafter, target and (greedy) acceptance
together as one CUDA graph on a GPU (`cuda_graphs.GraphedFunction`: a replay costs the host 10-40 µs);
`DSPARK_CUDA_GRAPHS=trees` hands it to `torch.compile(mode="reduce-overhead")` instead, whose CUDA-graph trees took
0.2-1.3 ms per replay. `drafter=None` decodes plainly on the same static cache
(greedy, with no eos to watch: one read of the device at the end): the fast plain baseline a speedup is measured
against. `target.generate(..., assistant_model=drafter, cache_implementation="static")` at batch 1 runs this loop
(`static_assisted_decoding`; transformers itself refuses assisted generation on a static cache). Greedy output equals
plain `generate()` (float32); sampling is lossless. Only temperature / top-k / top-p processing and eos /
`max_new_tokens` stopping are supported. The drafter's features come from a `TargetLayerTap` (hooks, traced into the
compiled graph), so any tapped layer works.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import NamedTuple, TypeVar

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedModel,
    StaticCache,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import StaticLayer
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..models import DSparkDraftModel, TargetLayerTap
from ..models.modeling import greedy_selector
from ..tensor_ops import argmax_last
from ..verify import triton_available, verify
from ..verify.reference import processed_scores
from . import fused_projections
from .candidate_generator import DSparkStats
from .cuda_graphs import CaptureKey, GraphedFunction, compiled_round
from .fused_markov import draft_tokens
from .policy import resolve_max_drafts, resolve_policy
from .stateful import check_own_loop_supported
from .static_attention import using_static_attention
from .target_features import check_drafter_fits_target

R = TypeVar("R")

PREFILL_CHUNK = 64  # prompt tokens per compiled prefill forward
MAX_PREFILL_CHUNKS = 8  # a longer prompt prefills in one eager forward (assumed: its compute outweighs its launches)


class PromptState(NamedTuple):
    """A prefilled prompt (`StaticRound.prefill`): its last logits [1, V] (float32); with a drafter, the features
    of the first round [1, C, K·H] and the target position they start at, and whether that round runs compiled
    (C = γ + 1) or eagerly (C = L, from 0: a prompt of at most γ + 1 tokens, or one whose drafter context could not
    be written outside a traced round)."""

    logits: torch.Tensor
    features: torch.Tensor | None
    context_start: torch.Tensor
    compiled_first: bool


def rewind(cache: StaticCache, length: torch.Tensor) -> None:
    """Sets every initialised layer's write position to `length` (a 0-d device tensor: no host sync)."""
    for layer in cache.layers:
        if layer.is_initialized:  # (the first forward allocates the layer)
            layer.cumulative_length.copy_(length)


def rewindable_cache(model: PreTrainedModel, max_length: int) -> StaticCache:
    """`model`'s `StaticCache` for `max_length` positions, refused (ValueError) unless every layer is a full-length
    `StaticLayer`: a sliding-window layer's ring buffer or a linear-attention state cannot be rolled back (or reused
    by the next call) by moving a write position, so the loop would silently decode something else."""
    cache = StaticCache(config=model.config, max_cache_len=max_length)
    others = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer})
    if others:
        raise ValueError(f"The static-cache fast path rolls rejected tokens back by moving each cache layer's write "
                         f"position, which only full-length StaticLayer supports; {type(model).__name__}'s static "
                         f"cache has {', '.join(others)} layers (sliding-window or linear attention). Use generate() "
                         "without cache_implementation='static' for this model.")
    return cache


ATTENTION_CHOICES = ("auto", "static_kernel", "model")  # static_generate(attention=...)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.LongTensor:
    """A token drawn from `probs` [B, V] by the exponential race: argmax p / E with E ~ Exp(1) (`noise` [B, V])."""
    return argmax_last(probs / noise)


class StaticVerifier:
    """The target on a `StaticCache`: `prefill(prompt)` and `forward(ids, positions)`, each returning float32 logits
    and the drafter's features (the tapped hidden states, concatenated; None without layers); `rollback(length)`."""

    def __init__(self, target: PreTrainedModel, layer_ids: list[int], max_length: int):
        self.target = target
        self.tap = TargetLayerTap(target, layer_ids) if layer_ids else None  # hooks live only inside `with self.tap`
        self.cache = rewindable_cache(target, max_length)

    def forward(self, ids: torch.LongTensor, positions: torch.LongTensor,
                logits_to_keep: int | torch.Tensor = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`logits_to_keep` as transformers' causal LMs take it: the last n rows (0: all) or a tensor of row indices
        (passed only when not 0, so a target without the argument still runs every other forward)."""
        keep = {} if isinstance(logits_to_keep, int) and logits_to_keep == 0 else dict(logits_to_keep=logits_to_keep)
        out = self.target(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True, **keep)
        return out.logits.float(), self.tap.features() if self.tap is not None else None

    def prefill(self, ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.tapping():
            return self.forward(ids, torch.arange(ids.shape[1], device=ids.device)[None])

    def tapping(self):
        """The context under which forwards record features (a no-op without tapped layers)."""
        return self.tap if self.tap is not None else nullcontext()

    def rollback(self, length: torch.Tensor) -> None:
        rewind(self.cache, length)


class StaticRound:
    """Target and drafter on static caches, the prompt's prefill (`prefill`) and the round function over them
    (`compiled` for every round after the prefill, which share one shape; eager for a first round after a short
    prompt: `PromptState.compiled_first`).

    `StaticRound.for_models(...)` keeps the last one built for a drafter (or a target decoding plainly) and reuses it
    while it fits, so repeated calls neither reallocate the caches nor recompile (dynamo recompiles a new instance,
    and gives up after a few)."""

    _kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def for_models(cls, target: PreTrainedModel, drafter: DSparkDraftModel | None, max_length: int,
                   compile: bool | dict, do_sample: bool) -> StaticRound:
        owner = drafter if drafter is not None else target
        kept = cls._kept.get(owner)
        if kept is None or kept.key != cls.key_of(target, compile, do_sample) or kept.max_length < max_length:
            kept = cls._kept[owner] = cls(target, drafter, max_length, compile, do_sample)
        zero = torch.zeros((), dtype=torch.long, device=target.device)
        kept.verifier.rollback(zero)
        if kept.drafter_cache is not None:
            rewind(kept.drafter_cache, zero)
        return kept

    @staticmethod
    def key_of(target: PreTrainedModel, compile: bool | dict, do_sample: bool) -> tuple:
        """What must match for a kept instance to be reused (besides fitting the length)."""
        return id(target), repr(compile), do_sample

    def __init__(self, target: PreTrainedModel, drafter: DSparkDraftModel | None, max_length: int,
                 compile: bool | dict, do_sample: bool):
        self.target, self.drafter, self.max_length = target, drafter, max_length
        self.key = self.key_of(target, compile, do_sample)
        layer_ids = drafter.config.target_layer_ids if drafter is not None else []
        self.verifier = StaticVerifier(target, layer_ids, max_length)
        self.drafter_cache = rewindable_cache(drafter, max_length) if drafter else None
        if do_sample:
            self.step = self._sampled_plain_step if drafter is None else self._sampled_round
        else:  # greedy keeps its state on the device, so rounds can be queued without the host reading anything
            self.step = self._greedy_plain_in_place if drafter is None else self._greedy_round_in_place
            device, width = target.device, 1 if drafter is None else drafter.config.num_draft_slots + 2
            self.record = torch.zeros(max_length, width, dtype=torch.long, device=device)  # one row per round
            self.round_index = torch.zeros((), dtype=torch.long, device=device)
            self.anchor = torch.zeros(1, dtype=torch.long, device=device)
            self.context_start = torch.zeros((), dtype=torch.long, device=device)
            self.position = torch.zeros((), dtype=torch.long, device=device)
            self.features = None  # [1, γ + 1, K·H], allocated by start_greedy (the tap decides width and dtype)
            for buffer in (self.record, self.round_index, self.anchor, self.context_start, self.position):
                torch._dynamo.mark_static_address(buffer)  # updated in place: CUDA graphs keep their addresses
        self.compiled = compiled_round(self.step, compile, target.device) if compile else self.step
        self.prefill_chunk = None  # compiled: prompts of up to MAX_PREFILL_CHUNKS chunks prefill chunk by chunk
        if compile:
            device = target.device
            self.chunk_ids = torch.zeros(1, PREFILL_CHUNK, dtype=torch.long, device=device)
            self.chunk_start = torch.zeros((), dtype=torch.long, device=device)  # the chunk's first position
            self.chunk_last = torch.zeros(1, dtype=torch.long, device=device)  # its row whose logits are kept
            for buffer in (self.chunk_ids, self.chunk_start, self.chunk_last):
                torch._dynamo.mark_static_address(buffer)
            self.prefill_chunk = compiled_round(self._prefill_chunk, compile, device)
        self.capture_key = CaptureKey()

    def keep_graph_valid(self, *choices: object) -> None:
        """Drops the captured round graph when what it reads has moved since the capture (parameters or buffers at
        new addresses: the models were moved, their projections fused anew) or other kernels were chosen
        (`choices`); the next rounds warm up and capture again."""
        graphs = [self.compiled] + ([self.prefill_chunk] if self.prefill_chunk is not None else [])
        self.capture_key.reset_if_moved(graphs, (self.target, self.drafter), *choices)

    # ------------------------------------------------------------------ the prompt
    def prefill(self, ids: torch.LongTensor) -> PromptState:
        """The prompt `ids` [1, L] into the caches (the target's, and with a drafter its context K/V of every prompt
        position but those the first round rewrites) -> `PromptState`. Compiled, a prompt of at most
        `MAX_PREFILL_CHUNKS` chunks (and no longer than the caches) runs as `PREFILL_CHUNK`-token forwards, each a
        replay of one graph (the first one eagerly while a cache or a fused projection has not seen a forward: that
        must not be traced; and, until the graph is captured, again for its warm-ups and capture, so that the first
        call pays for them, as it pays for the round's); otherwise, or for a longer prompt, one eager forward."""
        length, device = ids.shape[1], ids.device
        width = self.drafter.config.num_draft_slots + 1 if self.drafter is not None else 0
        zero = torch.zeros((), dtype=torch.long, device=device)
        if self.prefill_chunk is not None and max(length, PREFILL_CHUNK) <= min(self.max_length,
                                                                                MAX_PREFILL_CHUNKS * PREFILL_CHUNK):
            logits, features = self._chunked_prefill(ids)
            if features is None:
                return PromptState(logits, None, zero, True)
            if length >= width:  # the drafter's context is written: even a first round of the same shape is compiled
                return PromptState(logits, standard(features[:, -width:]), zero + length - width, True)
            return PromptState(logits, standard(features), zero, False)
        logits, features = self.verifier.prefill(ids)
        if features is None:
            return PromptState(logits[:, -1], None, zero, True)
        start = self.compiled_start(features, zero + length)
        if start is None:
            return PromptState(logits[:, -1], features, zero, False)
        return PromptState(logits[:, -1], *start, True)

    def _chunked_prefill(self, ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`prefill` in chunks -> (the last prompt row's logits [1, V], the prompt features of the last chunk
        [1, min(L, PREFILL_CHUNK), K·H] or None). Chunks start every `PREFILL_CHUNK` positions, the last one ending
        at the prompt's end (it may recompute some of its predecessor's positions); a prompt shorter than a chunk is
        padded after its end, and the positions there are overwritten before anything reads them."""
        length = ids.shape[1]
        padded = torch.nn.functional.pad(ids, (0, max(0, PREFILL_CHUNK - length)))
        starts = list(range(0, length - PREFILL_CHUNK, PREFILL_CHUNK)) + [max(0, length - PREFILL_CHUNK)]
        self.chunk_last.fill_(min(length, PREFILL_CHUNK) - 1)
        caches = [cache for cache in (self.verifier.cache, self.drafter_cache) if cache is not None]
        first_eager = (any(not cache.layers[0].is_initialized for cache in caches)
                       or any(fused_projections.watching(model) for model in (self.target, self.drafter)
                              if model is not None))
        chunk = self.prefill_chunk
        with self.verifier.tapping():
            for index, start in enumerate(starts):
                self.chunk_ids.copy_(padded[:, start: start + PREFILL_CHUNK])
                self.chunk_start.fill_(start)
                if index == 0:
                    if first_eager:
                        self._prefill_chunk()
                    # warm-ups and the capture now, not in a later call (a chunk run again writes the same rows)
                    while isinstance(chunk, GraphedFunction) and chunk.on_cuda and not chunk.captured:
                        chunk()
                logits, features = chunk()
        self.verifier.rollback(torch.full((), length, device=ids.device))  # (plain steps write where it points)
        return logits.clone(), None if features is None else features[:, :length]  # (a graph's next replay
        # overwrites its outputs: the caller copies what it keeps)

    def _prefill_chunk(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over `chunk_ids` at positions `chunk_start` .. (with a drafter, the drafter's context K/V of
        the same positions too) -> (float32 logits of row `chunk_last` [1, V], the chunk's features or None)."""
        start = self.chunk_start
        self.verifier.rollback(start)
        positions = (start + torch.arange(PREFILL_CHUNK, device=start.device))[None]
        logits, features = self.verifier.forward(self.chunk_ids, positions, logits_to_keep=self.chunk_last)
        if features is not None:
            self._write_drafter_context(features, start)
        return logits[:, -1], features

    def _write_drafter_context(self, features: torch.Tensor, start: torch.Tensor) -> None:
        """The drafter's context K/V of `features` [1, n, K·H] (target positions `start` ..) into its cache, by one
        drafter forward whose block output is not used."""
        rewind(self.drafter_cache, start)
        count, device = features.shape[1], start.device
        block = torch.full((1, 1), self.drafter.config.mask_token_id, dtype=torch.long, device=device)
        self.drafter(input_ids=block, target_hidden_states=features, past_key_values=self.drafter_cache,
                     context_position_ids=(start + torch.arange(count, device=device))[None],
                     position_ids=(start + count).view(1, 1))

    # ------------------------------------------------------------------ DSpark rounds
    # A greedy round's stages: draft_backbone, the drafter's draft_tokens (Markov loop), verify_forward,
    # greedy_verification and advance (bookkeeping); `profile_static_round` times them one by one.
    def draft_backbone(self, anchor, features, context_start, position):
        """The drafter's parallel forward after `anchor` [1] over `features` [1, C, K·H] (target positions
        context_start.. ; those before `position` are context) -> (slot hidden states, their base logits)."""
        drafter, device = self.drafter, position.device
        block = drafter.config.block_size
        rewind(self.drafter_cache, context_start)
        hidden = torch.cat([torch.arange(self.max_length, device=device) >= position,
                            torch.zeros(block, dtype=torch.bool, device=device)])  # cache rows that are not context
        dtype = drafter.compute_dtype
        mask = torch.zeros(1, 1, block, self.max_length + block, dtype=dtype, device=device)
        mask = mask.masked_fill(hidden, torch.finfo(dtype).min)
        return drafter.draft_backbone(anchor, features, self.drafter_cache,
                                      position_ids=(position + torch.arange(block, device=device))[None],
                                      context_position_ids=(context_start + torch.arange(features.shape[1],
                                                                                         device=device))[None],
                                      attention_mask=mask)

    def verify_forward(self, anchor, drafts, position):
        """The target over [anchor, drafts] at `position` -> (logits [1, γ + 1, V], its features there)."""
        self.verifier.rollback(position)
        ids = torch.cat([anchor[:, None], drafts], dim=1)
        return self.verifier.forward(ids, (position + torch.arange(ids.shape[1], device=position.device))[None])

    @staticmethod
    def greedy_verification(drafts, logits, position):
        """-> (host vector [accepted, γ + 1 target tokens], next anchor [1], next position)."""
        tokens = argmax_last(logits[0])
        accepted = (drafts[0] == tokens[:-1]).long().cumprod(dim=0).sum()
        return torch.cat([accepted[None], tokens]), tokens.gather(0, accepted[None]), position + accepted + 1

    def _draft_and_score(self, anchor, features, context_start, position, select):
        """Drafts after `anchor` and runs the target over [anchor, drafts] -> (drafts [1, γ], q logits (None for
        greedy drafts), target logits [1, γ + 1, V], the target's features of those γ + 1 positions)."""
        hidden, base_logits = self.draft_backbone(anchor, features, context_start, position)
        drafts, q_logits = draft_tokens(self.drafter, anchor, hidden, base_logits, select)
        logits, step_features = self.verify_forward(anchor, drafts, position)
        return drafts, q_logits, logits, step_features

    def greedy_round(self, anchor, features, context_start, position):
        """-> (host vector [accepted, γ + 1 target tokens], next anchor [1], next features, next position)."""
        drafts, _, logits, step_features = self._draft_and_score(anchor, features, context_start, position,
                                                                 greedy_selector)
        host, next_anchor, next_position = self.greedy_verification(drafts, logits, position)
        return host, next_anchor, step_features, next_position

    def _greedy_round_in_place(self) -> None:
        """`greedy_round` on the state buffers: records [accepted, tokens] in `record[round_index]` and advances."""
        self.advance(*self.greedy_round(self.anchor, self.features, self.context_start, self.position))

    def advance(self, host, anchor, features, position) -> None:
        """A greedy round's bookkeeping: `host` into `record[round_index]`, the state buffers to the next round."""
        self.record.index_copy_(0, self.round_index[None], host[None])
        self.round_index.add_(1)
        # the old position, computed anew: inductor may apply a copy of the `self.position` alias after updating it
        self.context_start.copy_(position - host[0] - 1)
        self.anchor.copy_(anchor)
        self.features.copy_(features)
        self.position.copy_(position)

    def compiled_start(self, features: torch.Tensor,
                       position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Lets the first round after the prefill run compiled: writes the drafter's context K/V for all prompt
        features `features` [1, L, K·H] but the last γ + 1 (eagerly, once), and returns those last γ + 1 with the
        position they start at, the shape and meaning of a round's features. None when the prompt is not longer than
        γ + 1 (the drafter's first forward, which sets up its cache and fused projections, must not be traced)."""
        width = self.drafter.config.num_draft_slots + 1
        start = features.shape[1] - width
        if start <= 0:
            return None
        self._write_drafter_context(features[:, :start], torch.zeros_like(position))
        return standard(features[:, start:]), position - width

    def start_greedy(self, anchor: torch.Tensor, position: torch.Tensor, features: torch.Tensor | None = None,
                     context_start: torch.Tensor | None = None) -> None:
        """Sets the state buffers for the first queued round (DSpark: its features and where they start)."""
        if features is not None:
            if self.features is None or self.features.shape != features.shape:
                self.features = torch.empty_like(features)
                torch._dynamo.mark_static_address(self.features)
                if isinstance(self.compiled, GraphedFunction):
                    self.compiled.reset()  # (a captured round reads the old buffer)
            self.features.copy_(features)
            self.context_start.copy_(context_start)
        self.anchor.copy_(anchor)
        self.position.copy_(position)
        self.round_index.zero_()

    def _sampled_round(self, anchor, features, context_start, position, noise, temperatures, top_ks, top_ps):
        """-> (drafts [1, γ], their q [1, γ, V], target logits, next features); `noise` [1, γ, V] ~ Exp(1)."""
        def select(drafted, logits):
            processed = processed_scores(logits, temperatures, top_ks, top_ps)
            return race(processed.softmax(dim=-1), noise[:, drafted.shape[1]]), processed

        drafts, q_logits, logits, step_features = self._draft_and_score(anchor, features, context_start, position,
                                                                        select)
        return drafts, q_logits.softmax(dim=-1), logits, step_features

    # ------------------------------------------------------------------ plain steps
    def _greedy_plain_step(self, token, position):
        """`token` [1] at `position` -> (the next token [1], position + 1)."""
        logits, _ = self.verifier.forward(token[:, None], position.view(1, 1))
        return argmax_last(logits[:, -1]), position + 1

    def _greedy_plain_in_place(self) -> None:
        token, position = self._greedy_plain_step(self.anchor, self.position)
        self.record.index_copy_(0, self.round_index[None], token[:, None])
        self.round_index.add_(1)
        self.anchor.copy_(token)
        self.position.copy_(position)

    def _sampled_plain_step(self, token, position, noise, temperatures, top_ks, top_ps):
        logits, _ = self.verifier.forward(token[:, None], position.view(1, 1))
        processed = processed_scores(logits[:, -1], temperatures, top_ks, top_ps)
        return race(processed.softmax(dim=-1), noise), position + 1


def standard(features: torch.Tensor) -> torch.Tensor:
    """A copy of `features` with standard strides, as a round's features have (`contiguous()` would keep a slice's
    batch stride)."""
    return features.clone(memory_format=torch.contiguous_format)


def exponential_noise(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Exp(1) noise for `race`, bounded away from 0."""
    return torch.empty(shape, device=device).exponential_(generator=generator).clamp_min_(1e-20)


def kernel_choice(target: PreTrainedModel, attention: str, fuse_projections: bool | None) -> tuple[bool, bool]:
    """(the static-cache attention kernel, fused projections): `static_generate`'s `attention` and
    `fuse_projections` arguments resolved for `target`'s device."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}.")
    if attention == "static_kernel" and not triton_available(target.device):
        raise ValueError("attention='static_kernel' needs Triton and a CUDA device (or TRITON_INTERPRET=1).")
    kernel = attention == "static_kernel" or (attention == "auto" and target.device.type == "cuda"
                                               and triton_available(target.device))
    return kernel, target.device.type == "cuda" if fuse_projections is None else fuse_projections


@contextmanager
def kernels_active(target: PreTrainedModel, drafter: DSparkDraftModel | None, kernel: bool,
                   fuse: bool) -> Iterator[None]:
    """The context in which the models' forwards run the chosen kernels (fused projections must be fused already)."""
    with (using_static_attention(target, drafter) if kernel else nullcontext(),
          fused_projections.projection_fusion() if fuse else nullcontext()):
        yield


@contextmanager
def fast_kernels(target: PreTrainedModel, drafter: DSparkDraftModel | None, attention: str,
                 fuse_projections: bool | None, build: Callable[[], R]) -> Iterator[R]:
    """The fast paths' kernels, shared by `static_generate`, `static_generate_batch` and `profile_static_round`:
    picks the attention (`attention`) and projection fusion (`fuse_projections`) as `static_generate` documents, and
    yields `build()` (the paths' kept caches and round) with both in effect."""
    kernel, fuse = kernel_choice(target, attention, fuse_projections)
    with kernels_active(target, drafter, kernel, fuse):
        built = build()
        if fuse:  # (after the caches are accepted: a refused model is left as it was)
            for model in (target, drafter):
                if model is not None:
                    fused_projections.fuse_projections(model)
        yield built


@contextmanager
def fast_path(target: PreTrainedModel, drafter: DSparkDraftModel | None, max_length: int, compile: bool | dict,
              do_sample: bool, attention: str = "auto", fuse_projections: bool | None = None) -> Iterator[StaticRound]:
    """`static_generate`'s set-up, shared with `profile_static_round`: checks the models and yields the (kept)
    `StaticRound` for `max_length` positions under `fast_kernels`."""
    if drafter is not None:
        check_drafter_fits_target(drafter.config, target)
        drafter.share_target_weights(target)
        if drafter.device != target.device:
            raise ValueError(f"static_generate() runs drafter and target in one graph on one device; the drafter is on "
                             f"{drafter.device}, the target on {target.device}. Move the drafter there, or use "
                             "generate() without cache_implementation='static'.")
    build = lambda: StaticRound.for_models(target, drafter, max_length, compile, do_sample)  # noqa: E731
    with fast_kernels(target, drafter, attention, fuse_projections, build) as rounds:
        rounds.keep_graph_valid(*kernel_choice(target, attention, fuse_projections))
        yield rounds


@torch.no_grad()
def static_generate(
    target: PreTrainedModel,
    drafter: DSparkDraftModel | None,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    compile: bool | dict = False,
    seed: int | None = None,
    attention: str = "auto",
    fuse_projections: bool | None = None,
) -> torch.LongTensor:
    """`[1, L]` prompt -> `[1, L + n]` with n <= max_new_tokens (fewer when eos ends it, eos kept).

    `drafter=None` decodes plainly on the static cache. `eos_token_id` defaults to the target's generation config.
    `compile`: True for the round compiled and captured as one CUDA graph on a GPU (`cuda_graphs.GraphedFunction`;
    with `DSPARK_CUDA_GRAPHS=trees`, `torch.compile(mode="reduce-overhead", dynamic=False)`), or a dict of
    `torch.compile` options (used as they are).
    `seed` seeds the draft sampling and verification noise. Round statistics go to
    `drafter.generation_stats` (as in `generate()`; a round is one function, so its whole wall-clock time is in
    `verify_seconds` and `draft_seconds` are 0; the device is not synchronised for them). `attention`: "auto" runs
    target and drafter attention with the static-cache Triton kernel on CUDA (`static_attention.py`) and the models'
    own implementation elsewhere; "static_kernel" or "model" force one. `fuse_projections` (default: on CUDA) computes
    sibling projections (q/k/v, gate/up) of target and drafter as one GEMM each; it rearranges the models' weights
    in place, invisibly to their state dicts and to code outside this loop (`fused_projections.py`)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"static_generate() decodes one prompt [1, L]; got shape {tuple(input_ids.shape)}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if do_sample and temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling; use do_sample=False for greedy.")
    block = drafter.config.block_size if drafter is not None else 0
    # greedy rounds are queued ahead and may run up to γ tokens past the budget
    max_length = input_ids.shape[1] + max_new_tokens + 2 * (block + 1)
    if compile:  # a prompt shorter than a prefill chunk is padded to one
        max_length = max(max_length, PREFILL_CHUNK)
    with fast_path(target, drafter, max_length, compile, do_sample, attention, fuse_projections) as rounds:
        device, length = target.device, input_ids.shape[1]
        eos = target.generation_config.eos_token_id if eos_token_id is None else eos_token_id
        eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        generator = torch.Generator(device=device)
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
        sampling = ()
        if do_sample:
            sampling = (torch.tensor([temperature], device=device),
                        None if top_k is None else torch.tensor([top_k], device=device),
                        None if top_p is None else torch.tensor([top_p], device=device))
        vocab = target.config.get_text_config().vocab_size
        prompt = rounds.prefill(input_ids.to(device))
        last = prompt.logits
        if do_sample:
            noise = exponential_noise((1, vocab), generator, device)
            first = race(processed_scores(last, *sampling).softmax(dim=-1), noise)
        else:
            first = last.argmax(dim=-1)
        position = torch.tensor(length, device=device)
        if not do_sample:
            out = greedy_loop(rounds, first, prompt, position, max_new_tokens, eos_ids)
        elif drafter is None:
            out = sampled_plain_loop(rounds, first, position, max_new_tokens, eos_ids, sampling, generator, vocab)
        else:
            out = sampled_dspark_loop(rounds, first, prompt, position, max_new_tokens, eos_ids, sampling, generator,
                                      vocab)
        out = out[:max_new_tokens]
        return torch.cat([input_ids, torch.tensor([out], dtype=input_ids.dtype, device=input_ids.device)], dim=1)


def commit(out: list[int], emitted: list[int], eos_ids: set[int]) -> bool:
    """Appends `emitted` to `out` up to and including its first eos; True when an eos ended generation there."""
    end = next((i for i, token in enumerate(emitted) if token in eos_ids), None)
    out += emitted if end is None else emitted[: end + 1]
    return end is not None


def record_round(stats: DSparkStats, drafted: int, accepted: int, committed: int, seconds: float) -> None:
    """One round in `stats`; a round is one function, so its whole time counts as verification."""
    stats.draft_seconds.append(0.0)
    stats.verify_seconds.append(seconds)
    stats.drafted.append(drafted)
    stats.accepted.append(accepted)
    stats.committed.append(committed)


# Rounds queued per host read when eos may end generation early (the queued rounds past an eos are wasted work).
ROUNDS_PER_READ_WITH_EOS = 8


def start_dspark_rounds(rounds: StaticRound, first, prompt: PromptState,
                        position) -> tuple[list[int], float] | None:
    """Sets the state buffers for the first queued greedy DSpark round after the prefill (`first` token, the
    `prompt`'s state, `position` = prompt length). When `prompt.compiled_first` that round runs compiled; otherwise
    it runs here, eagerly on all of the prompt, and its (record row, seconds) is returned."""
    if prompt.compiled_first:
        rounds.start_greedy(first, position, prompt.features, prompt.context_start)
        return None
    started = time.perf_counter()
    with rounds.verifier.tapping():
        host, anchor, step_features, next_position = rounds.greedy_round(first, prompt.features,
                                                                         prompt.context_start, position)
    rounds.start_greedy(anchor, next_position, step_features, position)
    return host.tolist(), time.perf_counter() - started


def greedy_loop(rounds: StaticRound, first, prompt: PromptState, position, max_new_tokens, eos_ids) -> list:
    """Greedy decoding from state kept on the device: the host queues as many rounds as cannot overshoot the budget
    (remaining tokens / tokens per round, at most `ROUNDS_PER_READ_WITH_EOS` while an eos may come), then reads their
    records in one synchronisation. DSpark's first round is compiled too unless `prompt` says otherwise; then it runs
    eagerly first."""
    drafter = rounds.drafter
    out = [int(first)]
    stats = None
    if drafter is not None:
        stats = drafter.generation_stats = DSparkStats()
    if out[-1] in eos_ids or max_new_tokens == 1:
        return out
    pending: list[tuple[list[int], float]] = []  # (record row, seconds) of rounds the host has not read yet
    if drafter is None:
        rounds.start_greedy(first, position)
        per_round = 1
    else:
        per_round = drafter.config.num_draft_slots + 1
        eager_round = start_dspark_rounds(rounds, first, prompt, position)
        if eager_round is not None:
            pending.append(eager_round)
    queued = 0
    while True:
        for row, seconds in pending:
            emitted = row[1: row[0] + 2] if drafter is not None else row
            if stats is not None:
                record_round(stats, per_round - 1, row[0], len(emitted), seconds)
            if commit(out, emitted, eos_ids) or len(out) >= max_new_tokens:
                return out
        count = -(-(max_new_tokens - len(out)) // per_round)
        if eos_ids:
            count = min(count, ROUNDS_PER_READ_WITH_EOS)
        started = time.perf_counter()
        with rounds.verifier.tapping():
            for _ in range(count):
                rounds.compiled()
        rows = rounds.record[queued: queued + count].tolist()  # the one sync for these rounds
        seconds = (time.perf_counter() - started) / count
        queued += count
        pending = [(row, seconds) for row in rows]


def sampled_plain_loop(rounds: StaticRound, token, position, max_new_tokens, eos_ids, sampling, generator,
                       vocab) -> list:
    """Plain sampling: one step per token; the host waits per step only to watch for eos."""
    tokens = [token]
    if eos_ids and int(token) in eos_ids:
        return [int(token)]
    while len(tokens) < max_new_tokens:
        noise = exponential_noise((1, vocab), generator, token.device)
        token, position = rounds.compiled(tokens[-1].clone(), position.clone(), noise, *sampling)
        tokens.append(token.clone())  # a CUDA graph reuses its output buffers next replay
        if eos_ids and int(token) in eos_ids:
            break
    return torch.cat(tokens).tolist()


def sampled_dspark_loop(rounds: StaticRound, first, prompt: PromptState, position, max_new_tokens, eos_ids, sampling,
                        generator, vocab) -> list:
    """DSpark sampling: every round through `rounds.compiled` (the first eagerly unless `prompt.compiled_first`),
    each verified by `dspark_hf.verify` after the graph; one host sync per round."""
    drafter, device = rounds.drafter, position.device
    gamma = drafter.config.num_draft_slots
    out = [int(first)]
    stats = drafter.generation_stats = DSparkStats()
    anchor, features, context_start = first, prompt.features, prompt.context_start
    step = rounds.compiled if prompt.compiled_first else rounds.step
    temperature, top_k, top_p = sampling
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        started = time.perf_counter()
        noise = exponential_noise((1, gamma, vocab), generator, device)
        with rounds.verifier.tapping():
            drafts, probs, logits, step_features = step(anchor, features, context_start, position, noise, *sampling)
        seeds = torch.randint(-(2**62), 2**62, (1,), generator=generator, device=device)
        result = verify(drafts[0], torch.tensor([gamma], device=device), logits[0], probs[0], do_sample=True,
                        temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, max_draft_len=gamma)
        accepted = result.num_accepted[0]
        host = torch.cat([result.num_accepted, result.output_tokens[0]]).tolist()  # the round's one sync
        # the next round reads these while a CUDA graph would overwrite its outputs: copy them out first
        anchor, features = result.output_tokens[0][accepted][None].clone(), step_features.clone()
        context_start, position = position, (position + accepted + 1).clone()
        step = rounds.compiled
        emitted = host[1: host[0] + 2]
        record_round(stats, gamma, host[0], len(emitted), time.perf_counter() - started)
        if commit(out, emitted, eos_ids):
            break
    return out


def fast_path_call(target: PreTrainedModel, drafter: DSparkDraftModel, input_ids: torch.LongTensor,
                   logits_processor: LogitsProcessorList, stopping_criteria: StoppingCriteriaList,
                   generation_config: GenerationConfig, synced_gpus: bool, streamer,
                   attention_mask) -> tuple[int, dict]:
    """What a `generate(assistant_model=drafter, cache_implementation="static")` call asks of the fast path: (the new
    tokens it allows, the keyword arguments of `static_generate` / `static_generate_batch`: temperature / top-k /
    top-p, eos, compiled on CUDA unless `disable_compile=True`, a seed from torch's global generator). Anything else
    (other logits processors or stopping criteria, a streamer, a padded prompt at batch 1, a scheduler policy or
    `dspark_gamma`) is refused with the reason, never silently dropped."""
    loop = "the static-cache fast path, cache_implementation='static'"
    check_own_loop_supported(target, generation_config, synced_gpus, loop)
    problems = []
    if streamer is not None:
        problems.append("a streamer (the fast path returns whole sequences)")
    if input_ids.shape[0] == 1 and attention_mask is not None and not bool(attention_mask.all()):
        problems.append("a padded prompt")
    if resolve_policy(generation_config, drafter) is not None or resolve_max_drafts(generation_config, drafter):
        problems.append("a scheduler policy or dspark_gamma (it verifies all drafts: pass dspark_policy='fixed')")
    settings = {}
    for processor in logits_processor:
        if isinstance(processor, TemperatureLogitsWarper):
            settings["temperature"] = float(processor.temperature)
        elif isinstance(processor, TopKLogitsWarper):
            settings["top_k"] = int(processor.top_k)
        elif isinstance(processor, TopPLogitsWarper):
            settings["top_p"] = float(processor.top_p)
        else:
            problems.append(type(processor).__name__)
    supported_criteria = (MaxLengthCriteria, EosTokenCriteria)
    problems += [type(c).__name__ for c in stopping_criteria if not isinstance(c, supported_criteria)]
    if problems:
        raise ValueError(f"{loop} supports temperature / top-k / top-p, eos and max_new_tokens only; this call also "
                         f"asks for: {', '.join(problems)}. Drop them or cache_implementation='static'.")
    eos = [int(token) for criterion in stopping_criteria if isinstance(criterion, EosTokenCriteria)
           for token in criterion.eos_token_id.flatten()]
    max_length = min((c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria)),
                     default=generation_config.max_length)
    return max_length - input_ids.shape[1], dict(
        settings, do_sample=bool(generation_config.do_sample), eos_token_id=eos,
        compile=target.device.type == "cuda" and not generation_config.disable_compile,
        seed=int(torch.randint(0, 2**62, (1,))))


def static_assisted_decoding(
    target: PreTrainedModel,
    drafter: DSparkDraftModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer=None,
    **model_kwargs,
):
    """What `generate(assistant_model=drafter, cache_implementation="static")` runs at batch 1 (same arguments as
    `GenerationMixin._assisted_decoding`): `static_generate` with what `fast_path_call` takes from the call."""
    new_tokens, arguments = fast_path_call(target, drafter, input_ids, logits_processor, stopping_criteria,
                                           generation_config, synced_gpus, streamer, model_kwargs.get("attention_mask"))
    sequences = input_ids
    if new_tokens > 0:
        sequences = static_generate(target, drafter, input_ids, new_tokens, **arguments)
    return GenerateDecoderOnlyOutput(sequences=sequences) if generation_config.return_dict_in_generate else sequences
