"""Batched decoding on static KV caches with a write position per row: the batch > 1 fast path (experimental).

`static_generate_batch(target, drafter, input_ids, attention_mask, max_new_tokens)` decodes a left-padded batch like
`generate(assistant_model=drafter)` with a fixed verify length (every round verifies all γ drafts of every row), and
every round is the same function of the same shapes:

- target and drafter each keep a `RowStaticCache`: [B, heads, capacity, d] buffers whose write position is per row,
  so a row's new states go to its own next columns. Rows that accepted different numbers of drafts stay dense: row
  b's column c always holds its position c - pad_b (pad_b: its left padding), and a rejected draft's column is
  simply written again by the next round;
- a round drafts from each row's previous verify features (the first a_b + 1 of them are context, the attention
  mask hides the rest), runs the Markov loop, the target's forward over [anchor, γ drafts] of every row, the
  acceptance, and moves each row's write positions past its accepted tokens;
- the rows' state lives in device buffers updated in place, so `compile=True` can capture a round as one CUDA graph,
  one per power-of-two batch bucket (`cuda_graphs.GraphedFunction`, the rows' graphs sharing one memory pool; with
  `DSPARK_CUDA_GRAPHS=trees`, `torch.compile(mode="reduce-overhead")`, whose replay cost the host 0.2-1.3 ms against
  10-40 µs); the host reads one record per round (one synchronisation). A sampled DSpark round returns its captured
  drafts and scores, which verification and `advance` read before the next replay.

Greedy acceptance runs inside the round. Sampling (temperature / top-k / top-p, the same for every row) draws drafts
by the exponential race on noise drawn before the round, so no generator runs inside it, and verifies them with
`dspark_hf.verify` after it. `drafter=None` decodes plainly on the same caches: the fast plain baseline at batch B.
A row stops at its first eos or after `max_new_tokens`; rows that have stopped keep computing (their tokens are
dropped) until all have. Greedy rows equal their solo plain `generate()` in float32, sampled rows follow the target's
distribution (tests/test_static_batch.py). Attention: on CUDA by default the batch-1 loop's static-cache Triton
kernel, which takes each row's additive mask, with fused projections (`static_loop.fast_kernels`); elsewhere the
models' own implementation with a 4D mask (SDPA by default).

For `DSparkEngine(static=True)`, rounds can also verify fewer drafts (`greedy_round(v)` / `sampled_round(v)`, one
graph per v) or none: a plain round then appends its target features to the drafter's pending context (up to
`context_window` columns, which `flush()` writes into the drafter cache; a drafting round reads the first γ + 1), so
that the next speculative round drafts from the whole context. A bare plain round (`greedy_round(0, bare=True)`)
keeps no features: the same graph as plain decoding without a drafter; `catch_up()` then rebuilds each row's drafter
context from its last 2 (γ + 1) tokens before the next drafting round.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, StaticLayer
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..models import DSparkDraftModel, TargetLayerTap
from ..models.modeling import greedy_selector
from ..tensor_ops import argmax_last, to_device
from ..verify import verify
from ..verify.reference import processed_scores
from .batched import BatchedDSparkStats, append_rows, padding_token
from .candidate_generator import DSparkStats
from .cuda_graphs import CaptureKey, Context, compiled_round, direct_graphs
from .fused_markov import draft_tokens
from .speculative_rows import check_batchable_target
from .static_attention import STATIC_ATTENTION
from .static_loop import commit, exponential_noise, fast_kernels, fast_path_call, kernel_choice, race
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
        batch, heads, length = key_states.shape[:3]
        device = self.device
        columns = (self.cumulative_length[:, None] + torch.arange(length, device=device))[:, None, :]  # [B, 1, T]
        index = (torch.arange(batch, device=device)[:, None, None], torch.arange(heads, device=device)[None, :, None],
                 columns)
        self.cumulative_length.add_(length)
        for cache, states in ((self.keys, key_states), (self.values, value_states)):
            # indexing the cache itself, not a view of it: inductor then writes just these columns. With `scatter_`
            # it copied the whole cache twice per layer and round (60 % of a Qwen3-4B-shaped round at 256 rows on
            # the H200), and so did torch 2.11 with `index_put_` into the cache's [B, C, heads, D] view.
            cache.index_put_(index, states)
        return self.keys, self.values

    def prefix(self, rows: int) -> RowStaticLayer:
        """This layer's first `rows` rows: a layer whose tensors are views of these (it writes into them)."""
        layer = copy.copy(self)
        layer.keys, layer.values = self.keys[:rows], self.values[:rows]
        layer.cumulative_length = self.cumulative_length[:rows]
        layer.batch_size = rows
        return layer


class RowStaticCache(Cache):
    """One `RowStaticLayer` per attention layer of a model: `capacity` columns for each of `batch_size` rows."""

    def __init__(self, num_layers: int, capacity: int, batch_size: int, device: torch.device):
        super().__init__(layers=[RowStaticLayer(capacity, batch_size, device) for _ in range(num_layers)])
        self.capacity = capacity

    def prefix(self, rows: int) -> RowStaticCache:
        """The cache of the first `rows` rows, a view of this one (`RowStaticLayer.prefix`)."""
        cache = copy.copy(self)
        cache.layers = [layer.prefix(rows) for layer in self.layers]
        return cache

    def move_to(self, columns: torch.Tensor) -> None:
        """Sets every row's write position (`columns` [B], on the device: no host sync)."""
        for layer in self.layers:
            layer.cumulative_length.copy_(columns)


def write_rows(cache: RowStaticCache, source: Cache, rows: torch.Tensor, width: int | None = None) -> None:
    """Copies the first k rows of `source`'s K/V [≥ k, heads, ≥ W, d] per layer, columns 0 .. W - 1 (default W: all
    of `source`'s), into rows `rows` (k of them) of `cache`."""
    count = len(rows)
    for layer, written in zip(cache.layers, source.layers):
        columns = written.keys.shape[2] if width is None else width
        layer.keys[rows, :, :columns] = written.keys[:count, :, :columns]
        layer.values[rows, :, :columns] = written.values[:count, :, :columns]


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
    device buffers, and `step()`: one round (`compiled` when compiling). Greedy and plain sampled rounds record
    their result in `record` and advance the rows; a sampled DSpark round returns its drafts and scores for
    `dspark_hf.verify`, after which `advance` does that.

    `StaticBatchRounds.for_models(...)` keeps the last one built for a drafter (or a target decoding plainly) and
    reuses it for the same batch size while it fits, so repeated calls neither reallocate nor recompile."""

    _kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def for_models(cls, target: PreTrainedModel, drafter: DSparkDraftModel | None, batch_size: int, capacity: int,
                   compile: bool | dict = False, do_sample: bool = False) -> StaticBatchRounds:
        owner = drafter if drafter is not None else target
        kept = cls._kept.get(owner)
        if (kept is None or kept.key != cls.key_of(target, batch_size, compile, do_sample)
                or kept.capacity < capacity):
            kept = cls._kept[owner] = cls(target, drafter, batch_size, capacity, compile, do_sample)
        return kept

    @staticmethod
    def key_of(target: PreTrainedModel, batch_size: int, compile: bool | dict, do_sample: bool) -> tuple:
        """What must match for a kept instance to be reused (besides fitting the length)."""
        return id(target), batch_size, repr(compile), do_sample

    def __init__(self, target: PreTrainedModel, drafter: DSparkDraftModel | None, batch_size: int, capacity: int,
                 compile: bool | dict = False, do_sample: bool = False, context_window: int | None = None,
                 kernels: Context = nullcontext):
        check_batchable_target(target)
        self.target, self.drafter, self.capacity = target, drafter, capacity
        self.kernels = kernels  # the context in which the models' forwards run the chosen kernels (`kernels_active`)
        self.key = self.key_of(target, batch_size, compile, do_sample)
        device = target.device
        text = target.config.get_text_config()
        self.target_cache = RowStaticCache(text.num_hidden_layers, capacity, batch_size, device)
        self.tap = None
        self.drafter_cache = None
        self.width = 1  # tokens a round runs the target on per row
        if drafter is not None:
            check_drafter_fits_target(drafter.config, target)
            drafter.share_target_weights(target)
            if drafter.device != device:
                raise ValueError(f"static_generate_batch() runs drafter and target in one graph on one device; the "
                                 f"drafter is on {drafter.device}, the target on {device}. Move the drafter there.")
            self.tap = TargetLayerTap(target, drafter.config.target_layer_ids)
            self.drafter_cache = RowStaticCache(drafter.config.num_hidden_layers, capacity, batch_size, device)
            self.width = drafter.config.num_draft_slots + 1
        # target features a row may hold pending for the drafter (`features`): a drafting round reads the first γ + 1,
        # plain rounds append up to `window`, which `flush()` writes into the drafter cache
        self.window = self.width if context_window is None else max(context_window, self.width)
        self.catch_up_tokens = 2 * self.width  # the tokens `catch_up` runs per row: γ + 1 of context, γ + 1 pending
        long = dict(dtype=torch.long, device=device)
        self.pad = torch.zeros(batch_size, **long)  # left padding: row b's column c is its position c - pad_b
        self.anchor = torch.zeros(batch_size, **long)  # the last committed token, not yet in the target cache
        self.column = torch.zeros(batch_size, **long)  # the anchor's column
        self.context_column = torch.zeros(batch_size, **long)  # where `features` start (DSpark)
        # the first column a drafting round lets the drafter see: the row's first (= pad), or where its context starts
        # when it joined without its prompt's (`start_rows(..., prompt_context=False)`)
        self.drafter_start = torch.zeros(batch_size, **long)
        self.active = torch.ones(batch_size, **long)  # 0 once a row has stopped: its columns stop moving
        self.features: torch.Tensor | None = None  # [B, γ + 1, K·H]: the last verify forward's target features
        self.record = torch.zeros(batch_size, 1 + self.width, **long)  # [accepted, emitted tokens] per row
        self.drafts = torch.zeros(batch_size, self.width - 1, **long)  # the last round's v drafts: [:, :v]
        self.replayed_acceptance: torch.Tensor | None = None  # `replay_acceptance()`: timing only
        if do_sample:  # DSpark: the graph drafts and scores; `dspark_hf.verify` and `advance` run after it
            self.step = self._sampled_plain_round if drafter is None else self._sampled_dspark_round
        else:
            self.step = self._plain_round if drafter is None else self._dspark_round
        self.compile = compile
        if compile:
            for buffer in (self.pad, self.anchor, self.column, self.context_column, self.drafter_start, self.active,
                           self.record, self.drafts):
                torch._dynamo.mark_static_address(buffer)
        # with direct graphs (cuda_graphs.py), the rounds share one memory pool (one round runs at a time, and what a
        # sampled DSpark round returns is read before the next one)
        self.graph_pool = (torch.cuda.graph_pool_handle() if direct_graphs(compile) and device.type == "cuda"
                           else None)
        self.compiled = self._compiled(self.step)
        self._rounds_by_kind: dict[tuple[str, int] | str, Callable] = {}
        self._prefixes: dict[int, StaticBatchRounds] = {}
        self.capture_key = CaptureKey()

    def _compiled(self, function: Callable, tapped: bool = True) -> Callable:
        """`function` compiled (`compiled_round`), its Python run with the chosen kernels and (`tapped`) the tap
        active."""
        if self.compile:
            # one dynamo entry per round function and shape: a few widths, kinds and row prefixes are more than its
            # default
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        return compiled_round(function, self.compile, self.target.device, self.graph_pool,
                              functools.partial(self._running, tapped))

    @contextmanager
    def _running(self, tapped: bool = True) -> Iterator[None]:
        """Where a round's Python runs: the chosen kernels, and (`tapped`) the tap recording the target's features."""
        with self.kernels(), self.tap if self.tap is not None and tapped else nullcontext():
            yield

    def keep_graphs_valid(self, *choices: object, also: Iterable[Callable] = ()) -> None:
        """Drops every captured graph of these rounds and their prefixes (and of `also`) when what they read has moved
        (parameters or buffers at new addresses) or other kernels were chosen (`choices`); each warms up and captures
        again."""
        functions = [function for rounds in (self, *self._prefixes.values())
                     for function in (rounds.compiled, *rounds._rounds_by_kind.values())]
        self.capture_key.reset_if_moved([*functions, *also], (self.target, self.drafter), *choices)

    def prefix(self, rows: int) -> StaticBatchRounds:
        """The rounds of the first `rows` rows alone (after `prefill`): state and caches are views of these, so what
        a round on it writes these hold, and it compiles graphs of its own. Kept per size. `DSparkEngine(static=True)`
        runs its rounds on the smallest prefix of its `graph_batch_sizes` that holds every request."""
        if rows == self.pad.shape[0]:
            return self
        if rows not in self._prefixes:
            view = copy.copy(self)
            for name in ("pad", "anchor", "column", "context_column", "drafter_start", "active", "record", "drafts",
                         "features", "replayed_acceptance"):
                tensor = getattr(self, name)
                if tensor is not None:
                    setattr(view, name, tensor[:rows])
                    if self.compile:
                        torch._dynamo.mark_static_address(getattr(view, name))
            view.target_cache = self.target_cache.prefix(rows)
            view.drafter_cache = self.drafter_cache.prefix(rows) if self.drafter_cache is not None else None
            view.step = view.compiled = None  # (bound to this instance; a prefix runs `greedy_round` and the like)
            view._rounds_by_kind, view._prefixes = {}, {}
            self._prefixes[rows] = view
        return self._prefixes[rows]

    def replay_acceptance(self) -> torch.Tensor:
        """Timing only (benchmarks on random-weight models): returns a [B] buffer of accepted-draft counts that every
        greedy drafting round takes instead of its own, capped at its width; write it in place before each round. The
        rows then commit the target's tokens, not the drafts they stand for, so the output means nothing. Call it
        before the first round (graphs read the buffer from their capture on)."""
        if self._rounds_by_kind or self._prefixes or self.drafter is None:
            raise RuntimeError("replay_acceptance() needs a drafter and must come before any round or prefix.")
        if self.replayed_acceptance is None:
            self.replayed_acceptance = torch.zeros_like(self.pad)
            if self.compile:
                torch._dynamo.mark_static_address(self.replayed_acceptance)
        return self.replayed_acceptance

    def greedy_round(self, verify: int, bare: bool = False) -> Callable[[], None]:
        """The greedy round that verifies the first `verify` of each row's drafts (0: a plain round, which with a
        drafter also appends its target features to the drafter's pending context; call `flush()` first when a
        row's pending context is full), compiled like `compiled`; one graph per `verify`. `bare` (plain rounds
        only): no features kept, the graph of plain decoding without a drafter; the rows' drafter context then needs
        `catch_up()` before the next drafting round."""
        plain = self._plain_round if self.drafter is None or bare else self._plain_round_with_context
        return self._round_of_kind("greedy", verify, plain, self._dspark_round, bare)

    def sampled_round(self, verify: int, bare: bool = False) -> Callable:
        """`greedy_round`'s sampled twin, called with (noise, temperatures, top_ks, top_ps), per row: noise ~ Exp(1)
        [B, V] for a plain round (which draws its token and records it), [B, ≥ v, V] for a drafting round (which returns
        (drafts [B, v], their q [B, v, V], target logits, target features) for `dspark_hf.verify`, then `advance`).
        Noise of ones with temperature 1 and no top-k / top-p draws a row's argmax: a greedy row."""
        plain = self._sampled_plain_round if self.drafter is None or bare else self._sampled_plain_round_with_context
        return self._round_of_kind("sampled", verify, plain, self._sampled_dspark_round, bare)

    def _round_of_kind(self, kind: str, verify: int, plain: Callable, drafting: Callable, bare: bool) -> Callable:
        if self.drafter is None and verify != 0:
            raise ValueError("plain decoding rounds (no drafter) verify no drafts.")
        if not 0 <= verify < self.width:
            raise ValueError(f"verify must be in 0..{self.width - 1}, got {verify}.")
        if bare and verify:
            raise ValueError("a bare round is a plain round: verify=0.")
        bare = bare and self.drafter is not None  # (without a drafter every plain round is bare)
        if (kind, verify, bare) not in self._rounds_by_kind:
            round_ = plain if verify == 0 else functools.partial(drafting, verify=verify)
            self._rounds_by_kind[kind, verify, bare] = self._compiled(round_, tapped=not bare)
        return self._rounds_by_kind[kind, verify, bare]

    def must_flush(self, verify: int, pending: int) -> bool:
        """Whether a round that verifies `verify` drafts must `flush()` first, when the fullest running row holds
        `pending` features pending: a plain round needs a free entry, a drafting round reads only the first γ + 1."""
        return self.drafter is not None and (pending >= self.window if verify == 0 else pending > self.width)

    def flush(self) -> None:
        """Writes every row's pending drafter context (the target features from `context_column` up to its anchor's
        column) into the drafter cache and empties it (compiled like `compiled`)."""
        self._run_compiled("flush", self._flush_context)

    def catch_up(self, recent: torch.LongTensor) -> None:
        """After bare plain rounds or admissions without the prompts' context (which keep no drafter features): each
        row's drafter context rebuilt from its last `catch_up_tokens` = 2 (γ + 1) tokens before its anchor, `recent`
        [B, 2 (γ + 1)] (columns column - 2 (γ + 1) .. column - 1; any token where those are padding), in one graph:
        the target's forward over them gives their features (and writes their K/V again), the first γ + 1 go into
        the drafter cache, the last γ + 1 are pending, as after a drafting round. The drafter then sees each row from
        the first of those columns on (its cache before them was not kept up). Every row's column must be at least
        2 (γ + 1) (`StaticRows` pads prompts so)."""
        self._run_compiled("catch_up", self._catch_up, recent)

    def _run_compiled(self, name: str, function: Callable[..., None], *args: torch.Tensor) -> None:
        """Calls `function(*args)` compiled like `compiled`, kept under `name` (its graph captured once)."""
        if name not in self._rounds_by_kind:
            self._rounds_by_kind[name] = self._compiled(function)
        self._rounds_by_kind[name](*args)

    def _catch_up(self, recent: torch.LongTensor) -> None:
        width = self.width
        first = (self.column - 2 * width).clamp(min=0)  # (free rows never admitted may be shorter: results unused)
        _, features = self._target_forward(recent, first, logits_to_keep=1)
        self._write_drafter_context(features[:, :width], first, first + width)
        self.features[:, :width].copy_(features[:, width:])
        self.context_column.copy_(first + width)
        torch.maximum(first, self.pad, out=self.drafter_start)

    # ------------------------------------------------------------------ target
    def _target_forward(self, ids: torch.LongTensor, first_column: torch.Tensor, logits_to_keep: int = 0,
                        tapped: bool = True):
        """The target over `ids` [B, T] written from `first_column` [B] -> (float32 logits of the last
        `logits_to_keep` tokens (0: all), features (None without a drafter or when not `tapped`: run outside the
        tap))."""
        self.target_cache.move_to(first_column)
        positions = (first_column - self.pad)[:, None] + torch.arange(ids.shape[1], device=ids.device)
        mask = visible_columns(self.pad, first_column, ids.shape[1], self.capacity, True, self.target.dtype)
        keep = dict(logits_to_keep=logits_to_keep) if logits_to_keep else {}
        if self.target.config._attn_implementation == STATIC_ATTENTION:  # the kernel skips the keys no query sees
            keep["key_bounds"] = torch.stack([self.pad, first_column + ids.shape[1]], dim=-1)
        logits = self.target(input_ids=ids, position_ids=positions.clamp(min=0), attention_mask=mask,
                             past_key_values=self.target_cache, use_cache=True, **keep).logits.float()
        return logits, self.tap.features() if self.tap is not None and tapped else None

    def prefill(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor,
                choose: Callable[[torch.Tensor], torch.LongTensor] = argmax_last) -> None:
        """The left-padded prompts [B, W]: fills the caches; `choose` picks each row's first token from its last
        logits [B, V] (into `record`)."""
        device = self.target.device
        self.pad.copy_((attention_mask == 0).sum(dim=1).to(device))
        self.drafter_start.copy_(self.pad)
        start = torch.zeros_like(self.pad)
        with self._running():
            logits, features = self._target_forward(input_ids.to(device), start)
        self.anchor.copy_(choose(logits[:, -1]))
        self.column.fill_(input_ids.shape[1])
        self.active.fill_(1)
        self.record.zero_()
        self.record[:, 1] = self.anchor
        if self.drafter is None:
            return
        # the drafter's context K/V for all prompt columns but the last γ + 1, which a round's features cover
        width = self.width
        context = input_ids.shape[1] - width
        self._write_drafter_context(features[:, :context], start, torch.full_like(self.pad, context))
        shape = (features.shape[0], self.window, features.shape[-1])
        if self.features is None or self.features.shape != shape:  # kept across calls
            self.features = features.new_zeros(shape)
            torch._dynamo.mark_static_address(self.features)  # updated in place: CUDA graphs keep its address
        self.features[:, :width].copy_(features[:, context:])
        self.context_column.fill_(context)

    def admit(self, slots: list[int], input_ids: torch.LongTensor, attention_mask: torch.Tensor,
              choose: Callable[[torch.Tensor], torch.LongTensor] = argmax_last, prompt_context: bool = True) -> None:
        """Prefills the left-padded prompts [k, W] (W >= γ + 2 with a drafter) into rows `slots`, which have stopped,
        while the other rows keep their state: one target forward (and one drafter context forward) on temporary
        caches whose K/V go into those rows' first W columns. Each new row's first token goes into `record`.
        `prompt_context=False` skips the drafter's forward and keeps no features: the rows need `catch_up()` before
        their first drafting round (`start_rows`)."""
        if not self.target_cache.layers[0].is_initialized:
            raise RuntimeError("admit() refills rows of a running batch: call prefill() first.")
        device = self.target.device
        index = to_device(slots, device, torch.long)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        pad = (attention_mask == 0).sum(dim=1)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        with self._running(tapped=prompt_context):  # (without the prompts' context: no features, as in the chunks)
            logits = self.target(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                                 past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
            features = self.tap.features() if self.tap is not None and prompt_context else None
        write_rows(self.target_cache, cache, index)
        width = input_ids.shape[1]
        if features is not None:
            context = width - self.width  # as in prefill: the last γ + 1 columns' features are the next round's
            drafter_cache = DynamicCache()
            block = torch.full((len(slots), 1), self.drafter.config.mask_token_id, dtype=torch.long, device=device)
            self.drafter(input_ids=block, target_hidden_states=features[:, :context], past_key_values=drafter_cache,
                         context_position_ids=positions[:, :context], position_ids=(context - pad)[:, None])
            write_rows(self.drafter_cache, drafter_cache, index)
            features = features[:, context:]
        self.start_rows(index, pad, choose(logits), width, features)

    def start_rows(self, index: torch.Tensor, pad: torch.Tensor, first: torch.Tensor, width: int,
                   features: torch.Tensor | None) -> None:
        """The state of rows `index` whose prompts (left padding `pad`) fill their first `width` columns of the caches:
        each row's first token `first` as its anchor and in `record`, and with a drafter the prompt's last γ + 1
        target features `features` [k, γ + 1, K·H], the next round's, whose drafter cache holds the prompt's context
        before them (`admit`, `ChunkedAdmission.admit`). `features=None`: the rows joined without their prompts'
        drafter context, and need `catch_up()` before their first drafting round."""
        self.pad[index] = pad
        self.anchor[index] = first
        self.column[index] = width
        self.active[index] = 1
        self.record[index] = 0
        self.record[index, 1] = first
        if self.drafter is not None and features is not None:
            self.features[index, : self.width] = features.to(self.features.dtype)
            self.context_column[index] = width - self.width
            self.drafter_start[index] = pad

    # ------------------------------------------------------------------ rounds
    def _plain_round(self) -> None:  # (also a drafter's bare plain round: no features)
        self._plain_step(argmax_last)

    def _sampled_plain_round(self, noise: torch.Tensor, temperatures, top_ks, top_ps) -> None:
        """`noise` [B, V] ~ Exp(1): each row's next token by the exponential race on its processed distribution."""
        self._plain_step(_racing(noise, temperatures, top_ks, top_ps))

    def _plain_step(self, choose: Callable[[torch.Tensor], torch.LongTensor], tapped: bool = False
                    ) -> torch.Tensor | None:
        """-> the anchors' target features [B, 1, K·H] (if `tapped`, with a drafter; else None)."""
        logits, features = self._target_forward(self.anchor[:, None], self.column, tapped=tapped)
        token = choose(logits[:, -1])
        self.record[:, 0] = 0
        self.record[:, 1] = token
        self.anchor.copy_(token)
        self.column.add_(self.active)
        return features

    def _plain_round_with_context(self) -> None:
        self._plain_step_with_context(argmax_last)

    def _sampled_plain_round_with_context(self, noise: torch.Tensor, temperatures, top_ks, top_ps) -> None:
        self._plain_step_with_context(_racing(noise, temperatures, top_ks, top_ps))

    def _plain_step_with_context(self, choose: Callable[[torch.Tensor], torch.LongTensor]) -> None:
        """A plain round that also appends each row's anchor features to its pending drafter context, at entry
        column - context_column of `features` (< `window` for every running row: `must_flush`)."""
        column = self.column.clone()  # before the round moves it
        features = self._plain_step(choose, tapped=True)
        entry = (column - self.context_column).clamp(max=self.window - 1)  # rows that have stopped may be full
        rows = torch.arange(entry.shape[0], device=entry.device)
        # in place, like RowStaticLayer.update (inductor lowered `scatter_` to a copy of the whole buffer)
        self.features.index_put_((rows[:, None], entry[:, None]), features.to(self.features.dtype))

    def _flush_context(self) -> None:
        self._write_drafter_context(self.features, self.context_column, self.column)
        self.context_column.copy_(self.column)

    def _write_drafter_context(self, features: torch.Tensor, first_column: torch.Tensor,
                               end_column: torch.Tensor) -> None:
        """Writes the drafter's context K/V of `features` [B, n, K·H] into its cache at each row's columns
        `first_column` .. + n - 1, in one drafter forward whose single block token (at `end_column`, seeing the
        columns before it) is not used."""
        drafter, device = self.drafter, self.anchor.device
        self.drafter_cache.move_to(first_column)
        block = torch.full((self.pad.shape[0], 1), drafter.config.mask_token_id, dtype=torch.long, device=device)
        mask = visible_columns(self.pad, end_column, 1, self.capacity + 1, False, drafter.compute_dtype)
        positions = (first_column - self.pad)[:, None] + torch.arange(features.shape[1], device=device)
        drafter(input_ids=block, target_hidden_states=features, past_key_values=self.drafter_cache,
                context_position_ids=positions.clamp(min=0), position_ids=(end_column - self.pad)[:, None],
                attention_mask=mask)

    def _draft_and_score(self, select, verify: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drafts the first `verify` tokens per row (default: all γ; `select` as `DSparkDraftModel.draft_tokens` takes
        it) and runs the target over [anchor, those drafts] -> (the drafts [B, v], their q logits, target logits
        [B, v + 1, V], target features). The drafter's block forward is the same for every v (its slots see each
        other), but only the v slots verified go through its LM head and the Markov loop, slot by slot, so the drafts
        are the first v of what a γ round drafts."""
        drafter, device = self.drafter, self.anchor.device
        block = drafter.config.block_size
        # the previous verify features are context up to the anchor's column; the rest is hidden, then overwritten
        self.drafter_cache.move_to(self.context_column)
        mask = visible_columns(self.drafter_start, self.column, block, self.capacity, False, drafter.compute_dtype)
        mask = torch.cat([mask, mask.new_zeros(mask.shape[0], 1, block, block)], dim=-1)
        context_positions = (self.context_column - self.pad)[:, None] + torch.arange(self.width, device=device)
        hidden, base_logits = drafter.draft_backbone(
            self.anchor, self.features[:, : self.width], self.drafter_cache,
            position_ids=(self.column - self.pad)[:, None] + torch.arange(block, device=device),
            context_position_ids=context_positions.clamp(min=0), num_tokens=verify, attention_mask=mask)
        drafts, q_logits = draft_tokens(drafter, self.anchor, hidden, base_logits, select)
        self.drafts[:, : drafts.shape[1]].copy_(drafts)
        logits, features = self._target_forward(torch.cat([self.anchor[:, None], drafts], dim=1), self.column)
        return drafts, q_logits, logits, features

    def _dspark_round(self, *, verify: int | None = None) -> None:
        drafts, _, logits, features = self._draft_and_score(greedy_selector, verify)
        tokens = argmax_last(logits)  # [B, v + 1]
        accepted = (drafts == tokens[:, :-1]).long().cumprod(dim=1).sum(dim=1)
        if self.replayed_acceptance is not None:
            accepted = self.replayed_acceptance.clamp(max=drafts.shape[1])
        self.advance(accepted, tokens, features)

    def _sampled_dspark_round(self, noise: torch.Tensor, temperatures, top_ks, top_ps, verify: int | None = None):
        """-> (the first `verify` drafts [B, v] (default: all), their q [B, v, V], target logits, target features) for
        `dspark_hf.verify`; `noise` [B, ≥ v, V] (slot j's drafts race on noise[:, j])."""
        def select(drafted, logits):
            processed = processed_scores(logits, temperatures, top_ks, top_ps)
            return race(processed.softmax(dim=-1), noise[:, drafted.shape[1]]), processed

        drafts, q_logits, logits, features = self._draft_and_score(select, verify)
        return drafts, q_logits.softmax(dim=-1), logits, features

    def advance(self, accepted: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """A DSpark round's bookkeeping: [accepted, tokens] into `record`, each row's anchor, features and columns to
        the next round (rows that have stopped keep their columns). A round that verified v < γ drafts fills the
        first v + 1 entries of `record`'s tokens and of `features` (the rest is never read)."""
        self.record[:, 0] = accepted
        self.record[:, 1: 1 + tokens.shape[1]] = tokens
        self.anchor.copy_(tokens.gather(1, accepted[:, None])[:, 0])
        self.features[:, : features.shape[1]].copy_(features)
        # the old column computed from the new one: inductor may apply a copy of the `self.column` alias after updating
        # it (static_loop.StaticRound.advance)
        moved = (accepted + 1) * self.active
        column = self.column + moved
        self.context_column.copy_(column - moved)
        self.column.copy_(column)


def _racing(noise: torch.Tensor, temperatures, top_ks, top_ps) -> Callable[[torch.Tensor], torch.LongTensor]:
    """Logits [B, V] -> each row's token by the exponential race on `noise` over its processed distribution."""
    return lambda logits: race(processed_scores(logits, temperatures, top_ks, top_ps).softmax(dim=-1), noise)


@torch.no_grad()
def static_generate_batch(
    target: PreTrainedModel,
    drafter: DSparkDraftModel | None,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
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
    max_batch_size: int | None = None,
) -> list[list[int]]:
    """Left-padded prompts [B, W] (`attention_mask` 1 on real tokens; None: no padding) -> each row's new tokens
    (at most `max_new_tokens`, up to and including its first eos). `drafter=None` decodes plainly. Sampling
    (`do_sample`, with `temperature` / `top_k` / `top_p` for every row) draws drafts by the exponential race on noise
    drawn before each round and verifies them with `dspark_hf.verify` after it; `seed` seeds both. `compile`: True
    for the round captured as one CUDA graph (see the module docstring), or a dict of `torch.compile` options (used
    as they are).
    Per-row round statistics go to `drafter.generation_stats` (a `BatchedDSparkStats`). Compiled, the batch is
    padded to the next power of two with copies of the first row that stop at once, so that a graph is captured
    per batch bucket; the rows' draws do not depend on that padding. Caches and the compiled round are kept for the
    next call of the same (padded) batch size (`StaticBatchRounds.for_models`). `attention` and `fuse_projections`
    as in `static_generate` (on CUDA by default: the static-cache Triton kernel, which takes each row's mask, and
    fused projections). `max_batch_size`: decode at most that many prompts at once; each further prompt takes the
    row of one that has finished (continuous batching on the static caches; default: all prompts at once)."""
    if input_ids.dim() != 2:
        raise ValueError(f"static_generate_batch() takes left-padded prompts [B, W]; got {tuple(input_ids.shape)}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if do_sample and temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling; use do_sample=False for greedy.")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not bool(attention_mask.any(dim=1).all()):
        raise ValueError("static_generate_batch() needs at least one prompt token per row.")
    width = 1 if drafter is None else drafter.config.num_draft_slots + 1
    if input_ids.shape[1] <= width:  # the drafter's first context must precede a round's γ + 1 features
        extra = width + 1 - input_ids.shape[1]
        input_ids = torch.nn.functional.pad(input_ids, (extra, 0))
        attention_mask = torch.nn.functional.pad(attention_mask, (extra, 0))
    rows = input_ids.shape[0]
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
    batch = rows if max_batch_size is None else min(rows, max_batch_size)
    if compile:  # one graph per power-of-two batch: spare rows copy the first one and stop at once
        batch = 1 << (batch - 1).bit_length()
    capacity = input_ids.shape[1] + max_new_tokens + 2 * width
    build = lambda: StaticBatchRounds.for_models(target, drafter, batch, capacity, compile, do_sample)  # noqa: E731
    with fast_kernels(target, drafter, attention, fuse_projections, build) as rounds:
        rounds.keep_graphs_valid(*kernel_choice(target, attention, fuse_projections))
        return _decode_rows(rounds, input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p,
                            eos_token_id, seed)


def _decode_rows(rounds: StaticBatchRounds, input_ids: torch.LongTensor, attention_mask: torch.Tensor,
                 max_new_tokens: int, do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
                 eos_token_id: int | list[int] | None, seed: int | None) -> list[list[int]]:
    """`static_generate_batch`'s decoding loop: the prompts [N, W] on the B rows of `rounds`. The first min(N, B)
    fill the rows (copies of the first one fill any spare rows, stopped at once); each later prompt is admitted
    into a row that has finished (`StaticBatchRounds.admit`)."""
    target, drafter = rounds.target, rounds.drafter
    requests, batch, width = input_ids.shape[0], rounds.pad.shape[0], rounds.width
    refill = requests > batch
    live = batch if refill else requests  # rows whose draws count; the others are spare copies
    eos = target.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    device, vocab = target.device, target.config.get_text_config().vocab_size
    choose = choose_first = argmax_last
    next_round = rounds.compiled
    if do_sample:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed) if seed is not None else generator.seed()
        sampling = (torch.full((batch,), float(temperature), device=device),
                    None if top_k is None else torch.full((batch,), top_k, device=device),
                    None if top_p is None else torch.full((batch,), float(top_p), device=device))

        def noise(*shape: int) -> torch.Tensor:
            """Exp(1) noise for the live rows, then ones for the spare rows (their draws are dropped)."""
            drawn = exponential_noise((live, *shape), generator, device)
            return torch.cat([drawn, drawn.new_ones(batch - live, *shape)])

        def choose(logits: torch.Tensor) -> torch.LongTensor:
            return _racing(noise(vocab), *sampling)(logits)

        def choose_first(logits: torch.Tensor) -> torch.LongTensor:  # the first tokens of k admitted rows
            settings = [None if value is None else value[: logits.shape[0]] for value in sampling]
            drawn = exponential_noise((logits.shape[0], vocab), generator, device)
            return _racing(drawn, *settings)(logits)

        def next_round() -> None:
            if drafter is None:
                return rounds.compiled(noise(vocab), *sampling)
            gamma = width - 1
            drafts, probs, logits, features = rounds.compiled(noise(gamma, vocab), *sampling)
            seeds = torch.randint(-(2**62), 2**62, (live,), generator=generator, device=device)
            seeds = torch.cat([seeds, seeds.new_zeros(batch - live)])
            result = verify(drafts.reshape(-1), torch.full((batch,), gamma, device=device), logits.reshape(-1, vocab),
                            probs.reshape(-1, vocab), do_sample=True, temperature=temperature, top_k=top_k,
                            top_p=top_p, seeds=seeds, max_draft_len=gamma)
            rounds.advance(result.num_accepted, result.output_tokens, features)

    first_rows = list(range(min(requests, batch))) + [0] * max(0, batch - requests)
    rounds.prefill(input_ids[first_rows], attention_mask[first_rows], choose)
    outputs: list[list[int]] = [[] for _ in range(requests)]
    stats = [DSparkStats() for _ in range(requests)]
    owner: list[int | None] = [row if row < requests else None for row in range(batch)]  # each row's request
    waiting = list(range(batch, requests))

    def commit_tokens(row: int, tokens: list[int]) -> int:
        """Commits a row's new tokens to its request; frees the row when the request has ended."""
        request = owner[row]
        before = len(outputs[request])
        ended = commit(outputs[request], tokens[: max_new_tokens - before], eos_ids)
        if ended or len(outputs[request]) >= max_new_tokens:
            owner[row] = None
            rounds.active[row] = 0
        return len(outputs[request]) - before

    for row, token in enumerate(rounds.record[:, 1].tolist()):
        if owner[row] is None:
            rounds.active[row] = 0
        else:
            commit_tokens(row, [token])
    while any(request is not None for request in owner) or waiting:
        free = [row for row, request in enumerate(owner) if request is None][: len(waiting)]
        if free:
            admitted, waiting = waiting[: len(free)], waiting[len(free):]
            rounds.admit(free, input_ids[admitted], attention_mask[admitted], choose_first)
            for row, request, token in zip(free, admitted, rounds.record[free, 1].tolist()):
                owner[row] = request
                commit_tokens(row, [token])
            continue  # a request can end at its first token: admit again before the next round
        next_round()
        for row, (accepted, *tokens) in enumerate(rounds.record.tolist()):  # the round's one synchronisation
            request = owner[row]
            if request is None:
                continue
            committed = commit_tokens(row, tokens[: accepted + 1])
            stats[request].drafted.append(width - 1)
            stats[request].accepted.append(accepted)
            stats[request].committed.append(committed)
    if drafter is not None:
        drafter.generation_stats = BatchedDSparkStats(stats)
    return outputs


def static_assisted_decoding_batch(
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
    """What `generate(assistant_model=drafter, cache_implementation="static")` runs at batch > 1 (same arguments as
    `GenerationMixin._assisted_decoding`): `static_generate_batch` on the left-padded prompts with what
    `static_loop.fast_path_call` takes from the call; finished rows are filled with the pad token, as plain batched
    `generate()` fills them."""
    attention_mask = model_kwargs.get("attention_mask")
    new_tokens, arguments = fast_path_call(target, drafter, input_ids, logits_processor, stopping_criteria,
                                           generation_config, synced_gpus, streamer, attention_mask)
    sequences = input_ids
    if new_tokens > 0:
        generated = static_generate_batch(target, drafter, input_ids, attention_mask, new_tokens, **arguments)
        sequences = append_rows(input_ids, generated, padding_token(generation_config))
    return GenerateDecoderOnlyOutput(sequences=sequences) if generation_config.return_dict_in_generate else sequences
