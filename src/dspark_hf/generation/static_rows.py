"""`StaticRows`: `DSparkEngine`'s rows on static caches (`DSparkEngine(..., static=True)`).

The same interface as `SpeculativeRows` (`rows`, `add`, `step`, `remove`), over a `StaticBatchRounds` of
`max_batch_size` rows: a request takes the lowest free row (`ChunkedAdmission.admit`), every round drafts for the
rows of the smallest allowed prefix that holds every request (`graph_batch_sizes`, default the powers of two and
`max_batch_size`; `StaticBatchRounds.prefix`) and verifies the same number v of drafts of each in one target forward
(one CUDA graph per prefix and v with `compile=True`, one host read per round), and a finished or cancelled request
frees its row. Free rows inside the prefix keep computing until a request takes them (their results are dropped).
v is fixed, or chosen each round by a `RoundWidthChooser` from measured round times and acceptance (v = 0: a plain
round, whose target features go to the drafter's pending context). A round with only greedy requests runs the
greedy graph; one with any sampled request runs the sampled graph, in which each row draws with its own temperature
/ top-k / top-p on Exp(1) noise (greedy rows on noise of ones: their argmax), and `dspark_hf.verify` accepts per row
(greedy rows greedily) after it.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Iterable
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..devices import synchronize
from ..models import DSparkDraftModel
from ..scheduling import RoundWidthChooser
from ..scheduling.round_widths import AFTER_PLAIN, FULL, PROBES
from ..tensor_ops import argmax_last, to_device
from ..verify import verify as verify_drafts
from .cuda_graphs import WARMUP_CALLS as GRAPH_WARMUP_CALLS
from .profiling import RoundProfiler
from .speculative_rows import Row, left_padded
from .static_admission import ChunkedAdmission
from .static_batch import StaticBatchRounds
from .static_loop import exponential_noise, fast_kernels, kernel_choice, kernels_active


PENDING_ROUNDS = 4  # the drafter's pending context holds 4 (γ + 1) features: plain rounds flush it 4x less often

# After this many plain rounds in a row, plain rounds are bare (no target features kept for the drafter: the graph of
# plain decoding without one) and requests join without their prompt's drafter context or features: a round and a
# join then cost what they cost without a drafter. Before the next drafting round, `StaticBatchRounds.catch_up`
# rebuilds each row's drafter context from its last 2 (γ + 1) = 16 tokens (γ = 7). On the development CPU the trained
# code50m drafter kept 97 % of its τ without its prompt, 96 % with its last 16 positions alone
# (drafter_context_reach_cpu.json). The chooser's probing rounds (`PROBES`: a measure, confirm or refresh of a width
# not chosen) neither end nor lengthen such a run (each catches up first).
PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER = 32


def cache_capacity(max_model_len: int, span: int, speculative: bool, admission_chunk: int) -> int:
    """The KV columns of each row for requests of `max_model_len` tokens whose rounds run at most `span` tokens per
    row: a short prompt's left padding, a round's overshoot past max_tokens, a speculative engine's drafter reach past
    the anchor (its pending context), and a prompt's padding to whole admission chunks."""
    reach = span + (PENDING_ROUNDS * span if speculative else 0)
    return max_model_len + span + reach + admission_chunk


def graph_kind(kind: str, bare: bool) -> str:
    """The name `StaticRows.warmed` keeps a round graph under: its kind ("greedy", "sampled", "filtered"), "bare ..."
    for a bare plain round."""
    return f"bare {kind}" if bare else kind


def plain_run_after(run: int, verify: int, reason: str | None) -> int:
    """The plain rounds in a row after a round that verified `verify` drafts for the chooser's `reason` (None: no
    chooser): a plain round lengthens the run, a probe (`PROBES`) leaves it as it was, any other round ends it."""
    if not verify:
        return run + 1
    return run if reason in PROBES else 0


# `warm_up` runs each graph this often: the warm-up calls of a directly captured graph (the first compiles), then its
# capture (cuda_graphs.py); reduce-overhead's graph trees compile on the first call and capture on the second
WARM_UP_CALLS = GRAPH_WARMUP_CALLS + 1


class StaticRows:
    """Rows of `DSparkEngine` on a `StaticBatchRounds` of `max_batch_size` rows and `max_model_len` positions.
    `drafter=None`: plain decoding rounds. Each round verifies `verify` drafts of every row (default: all γ), or as many
    as `chooser` picks. The chooser's host work (24-39 µs a round on the H200 host) overlaps the device's: while a round
    runs, the round before it is recorded, then the next round's width chosen for as many rows as this one runs
    (chosen again if the next round runs another number); a choice thus reads every round but the last, as it did
    when made right before its round. `sampler` (the engine's `RequestSampler`: `params(rows, device)`,
    `first_tokens(rows, logits)` and its `generator`) draws sampled requests' tokens; without one every request
    decodes greedily. `compile`, `attention`, `fuse_projections` as in `static_generate_batch`
    (`compile=True`: one CUDA graph per row prefix, number of verified drafts and kind, greedy or sampled).
    `graph_batch_sizes`: the numbers of rows a round may run, each round the smallest that holds every request
    (`max_batch_size` is always one; default: the powers of two below it). Fewer sizes compile fewer graphs; the rounds
    of a batch that drains then run more free rows. Admission (`add`): requests join by `ChunkedAdmission` in chunks of
    `admission_chunk` tokens (one graph whatever their lengths), up to `admission_rows` of similar lengths at once, or,
    when at least `eager_admission_from` requests of similar lengths join at once (default: 8 × `admission_rows`, a
    group its chunks would take 8 passes to admit), in one eager forward with the others: an eager forward of a small
    model costs about as much for one prompt as for a few, 10-16 ms on the H200 for the 50M fixture, a chunk well under
    1 ms (docs/serving.md). After `PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER` plain rounds in a row, plain rounds are
    bare and requests join without their prompt's drafter context, both without the drafter's features; the next
    drafting round first catches up (`StaticBatchRounds.catch_up`: the drafter then sees each row from its last
    2 (γ + 1) tokens on)."""

    def __init__(self, target: PreTrainedModel, drafter: DSparkDraftModel | None, max_batch_size: int,
                 max_model_len: int, compile: bool | dict = False, attention: str = "auto",
                 fuse_projections: bool | None = None, verify: int | None = None,
                 chooser: RoundWidthChooser | None = None, sampler=None,
                 graph_batch_sizes: Iterable[int] | None = None, admission_chunk: int = 64,
                 admission_rows: int = 1, eager_admission_from: int | None = None):
        span = 1 if drafter is None else drafter.config.num_draft_slots + 1  # the most tokens a round runs per row
        self.span, self.batch_size = span, max_batch_size
        if graph_batch_sizes is None:
            graph_batch_sizes = [1 << power for power in range(max_batch_size.bit_length())]
        graph_batch_sizes = sorted({*graph_batch_sizes, max_batch_size})
        if graph_batch_sizes[0] < 1 or graph_batch_sizes[-1] > max_batch_size:
            raise ValueError(f"graph_batch_sizes must lie in 1..max_batch_size ({max_batch_size}), got "
                             f"{graph_batch_sizes}.")
        self.graph_batch_sizes = tuple(graph_batch_sizes)
        self.eager_admission_from = (8 * min(admission_rows, max_batch_size) if eager_admission_from is None
                                     else eager_admission_from)
        self.set_policy(verify, chooser)
        window = PENDING_ROUNDS * span if drafter is not None else 0
        self.reach = span + window
        capacity = cache_capacity(max_model_len, span, drafter is not None, admission_chunk)

        self.kernel_choice = kernel_choice(target, attention, fuse_projections)  # (static attention, fused projections)

        def kernels():  # entered whenever the models' Python runs (not around graph replays): the models are shared
            return kernels_active(target, drafter, *self.kernel_choice)

        def build() -> tuple[StaticBatchRounds, ChunkedAdmission]:
            rounds = StaticBatchRounds(target, drafter, max_batch_size, capacity, compile,
                                       context_window=window or None, kernels=kernels)
            return rounds, ChunkedAdmission(rounds, admission_chunk, min(admission_rows, max_batch_size))

        with fast_kernels(target, drafter, attention, fuse_projections, build) as (rounds, admission):
            self.rounds, self.admission = rounds, admission
        self.owner: list[Row | None] = [None] * max_batch_size  # each row's request
        self._occupied: list[int] | None = None  # `occupied` and `rows`, until the next `add` / `remove`
        self._rows: list[Row] | None = None
        self.pending = [0] * max_batch_size  # per row: target features pending for the drafter's context (0: free)
        # per row, its `acceptance_state` after the last round, if `_states_current` (kept for rounds of at most the
        # chooser's `state_rows` rows; AFTER_PLAIN for rows that joined since; after a plain round every row's is
        # AFTER_PLAIN, whatever this holds)
        self.acceptance_states = [AFTER_PLAIN] * max_batch_size
        self._states_current = True
        self.sampler = sampler
        self.sampled = [False] * max_batch_size  # per row: does its request sample
        self.filtered = [False] * max_batch_size  # ... with top-k or top-p (else the rounds skip their sort)
        device = target.device  # per row (sampled rounds): temperature, top-k (0: off), top-p; free rows: greedy
        self.temperature = torch.ones(max_batch_size, device=device)
        self.top_k = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.top_p = torch.ones(max_batch_size, device=device)
        self._rows_set_to_sample: set[int] = set()  # rows whose device settings above are a sampled request's
        self.vocab_size = target.config.get_text_config().vocab_size
        self.started = False
        self.drafted_last_round = drafter is not None
        self.upkeep: str | None = None  # the drafter-context upkeep the last round ran first: "flush", "catch_up", None
        self.plain_rounds_in_a_row = 0  # (PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER)
        self.behind = False  # bare rounds or admissions since the last catch-up: the next drafting round catches up
        self.admitted_without_prompt_context = 0  # requests that joined so, since the engine was made
        self.profiler: RoundProfiler | None = None
        self.guard = None
        self.warmed: set[tuple[int, str, int]] = set()  # (rows, kind, width) of the graphs `warm_up` ran twice
        # per row prefix, the catch-up graph's seconds as `warm_up` timed it: a round that ran a catch-up first is
        # timed for the chooser without it (0 where not timed)
        self.catch_up_seconds: dict[int, float] = {}

    def set_policy(self, verify: int | None = None, chooser: RoundWidthChooser | None = None) -> None:
        """Each round verifies `verify` drafts of every row (None: all γ), or as many as `chooser` picks. May change
        between rounds: the graphs of the widths already run are kept."""
        longest = self.span - 1 if chooser is None else max(chooser.widths)
        verify = longest if verify is None and chooser is None else verify
        if longest > self.span - 1 or (verify is not None and not 0 <= verify <= self.span - 1) \
                or (chooser is not None and verify is not None):
            raise ValueError(f"a round verifies at most the drafter's {self.span - 1} drafts (none without a drafter), "
                             f"a fixed number or a chooser's: verify={verify}, chooser widths "
                             f"{None if chooser is None else chooser.widths}.")
        self.verify, self.chooser = verify, chooser
        self._unrecorded: tuple | None = None  # the last round, for `chooser.record` during the next one
        self._last_round_started = self._round_ended = 0.0  # (time.perf_counter())
        self._round_overhead: float | None = None  # `finish_round`
        # (the chooser's group of rounds, width, choice): the next round's width, chosen during this one
        self._planned: tuple[tuple[int, int], int, tuple] | None = None
        self.choice: tuple[str, dict[int, float] | None] | None = None  # the last round's (chooser.reason, .rates)

    @property
    def rows(self) -> list[Row]:
        """The running requests' rows, in row order (kept until `add` / `remove`: the engine reads them several
        times a round; do not modify)."""
        if self._rows is None:
            self._rows = [self.owner[index] for index in self.occupied]
        return self._rows

    @property
    def occupied(self) -> list[int]:
        """The indices of the rows that hold a request, ascending (kept like `rows`)."""
        if self._occupied is None:
            self._occupied = [index for index, owner in enumerate(self.owner) if owner is not None]
        return self._occupied

    def _owners_changed(self) -> None:
        self._occupied = self._rows = None

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
        drafter's first context; to whole admission chunks), every row of a group must still fit its budget and what
        rounds write past it."""
        groups: list[list[Row]] = []
        for row in sorted(rows, key=lambda row: -len(row.ids)):
            if groups:
                width = self.admission.padded_width(len(groups[-1][0].ids))
                if width + row.max_new + self.reach <= self.rounds.capacity:
                    groups[-1].append(row)
                    continue
            groups.append([row])
        return groups

    @torch.no_grad()
    def add(self, rows: list[Row]) -> list[list[int]]:
        """Gives each of `rows` a free row and prefills it: the first call in one eager forward per group of similar
        lengths (which sets up every row), later ones by `ChunkedAdmission`, `admission_rows` requests at a time, or,
        for groups of at least `eager_admission_from` requests, in one eager forward per group
        (`StaticBatchRounds.admit`). Returns the one token each committed, in `rows` order."""
        free = [index for index, owner in enumerate(self.owner) if owner is None]
        if len(free) < len(rows):
            raise RuntimeError(f"{len(rows)} requests for {len(free)} free rows.")
        if len(free) == self.batch_size:  # idle until now: the models may have moved since the last requests
            self.keep_graphs_valid()
        rounds, first = self.rounds, {}
        prompt_context = not self._in_a_long_plain_run()
        if not prompt_context and self.rounds.drafter is not None and self.started:
            self.admitted_without_prompt_context += len(rows)
            self.behind = True
        timed = self.chooser is not None and self.started  # (the first prefill, of every row, is no steady cost)
        started = time.perf_counter()
        with self._part("prefill"):
            for group in self._groups(rows):
                slots, free = free[: len(group)], free[len(group):]
                self._set_sampling(slots, group)
                # at least 2 (γ + 1) columns: a drafter's first context, and what `catch_up` reads
                ids, mask = left_padded(group, min_width=self.rounds.catch_up_tokens)
                mask = mask.long()
                if self.started and len(group) < self.eager_admission_from:  # in chunks, `admission.rows` at a time
                    for start in range(0, len(group), self.admission.rows):
                        part = slice(start, start + self.admission.rows)
                        self.admission.admit(slots[part], ids[part], mask[part], self._first_tokens(group[part]),
                                             prompt_context)
                elif self.started:  # one eager forward for the whole group
                    rounds.admit(slots, ids, mask, self._first_tokens(group), prompt_context)
                else:  # the first prefill sets up every row; rows without a request stop at once
                    spare = [0] * (self.batch_size - len(group))
                    choose = self._first_tokens(group + [group[0]] * len(spare))
                    rounds.prefill(torch.cat([ids, ids[spare]]), torch.cat([mask, mask[spare]]), choose)
                    rounds.active[len(group):] = 0
                    self.started = True
                for slot, row, token in zip(slots, group, rounds.record[slots, 1].tolist()):
                    self.owner[slot] = row
                    self.pending[slot] = self.span  # a prefill leaves its last γ + 1 features pending
                    self.acceptance_states[slot] = AFTER_PLAIN
                    first[id(row)] = token
                self._owners_changed()
        if timed:  # (the first tokens read above: the device is done)
            self.chooser.record_admission(time.perf_counter() - started, len(rows), prompt_context)
        for row in rows:
            row.ids.append(first[id(row)])
        return [[first[id(row)]] for row in rows]

    def keep_graphs_valid(self) -> None:
        """Drops the captured graphs of the rounds and the admission chunk when the models' parameters or buffers
        moved since they were captured (direct CUDA graphs read them where they were); checked before `warm_up` and
        whenever requests arrive at an idle batch."""
        admission = self.admission
        self.rounds.keep_graphs_valid(*self.kernel_choice, also=[admission.compiled_chunk,
                                                                  admission.compiled_chunk_without_context])

    @torch.no_grad()
    def warm_up(self, widths: Iterable[int] | None = None, sampled: bool = False, progress: bool = False) -> int:
        """Runs, before the first request, every graph that rounds verifying `widths` drafts (default: the policy's)
        can run, `WARM_UP_CALLS` times: per row prefix, each width's greedy round, with `sampled` its two sampled rounds
        (with and without top-k / top-p), and when plain rounds are among `widths` (with a drafter) the bare plain
        rounds of each kind ("bare greedy", ...), the flush and the catch-up; and the admission chunk (with plain rounds
        among `widths` also the one without the drafter's context of the prompts).
        With `compile`, these calls compile and capture the CUDA graphs, so that served rounds only replay graphs and
        the chooser times them from the first (on the H200 a round's first capture took 2-4x its time).
        The rounds run on free rows, whose results are dropped. With a chooser and plain rounds among `widths`, it
        then times the two admission chunks (`RoundWidthChooser.admission_ratio`) and each prefix's catch-up
        (`catch_up_seconds`). Returns the number of graphs run."""
        if self.rows:
            raise RuntimeError("warm_up() runs before the first request.")
        self.keep_graphs_valid()
        if sampled and self.sampler is None:
            raise ValueError("warm_up(sampled=True) needs a sampler.")
        widths = sorted(set(widths if widths is not None else
                            self.chooser.widths if self.chooser is not None else [self.verify]))
        if not all(0 <= width < self.span for width in widths):
            raise ValueError(f"widths must be in 0..{self.span - 1}, got {widths}.")
        if not self.started:  # the first prefill sets up every row (on a dummy prompt); all rows stay free
            prompt = torch.zeros(self.batch_size, self.rounds.catch_up_tokens, dtype=torch.long)
            self.rounds.prefill(prompt, torch.ones_like(prompt))
            self.rounds.active.zero_()
            self.started = True
        sizes = self.graph_batch_sizes
        kinds = ["greedy", *(["sampled", "filtered"] if sampled else [])]
        graphs = [(size, kind, width, False) for size in sizes for width in widths for kind in kinds]
        plain_with_drafter = 0 in widths and self.rounds.drafter is not None
        upkeeps = []
        if plain_with_drafter:
            graphs += [(size, kind, 0, True) for size in sizes for kind in kinds]
            upkeeps = [(size, kind) for size in sizes for kind in ("flush", "catch_up")]
        chunks = [True, False] if plain_with_drafter else [True]  # (with and without the prompts' drafter context)
        with tqdm(total=len(graphs) + len(upkeeps) + len(chunks), desc="round graphs", disable=not progress) as bar:
            for size, kind, width, bare in graphs:
                rounds = self.rounds.prefix(size)
                for _ in range(WARM_UP_CALLS):
                    if kind == "greedy":
                        rounds.greedy_round(width, bare)()
                    else:
                        self._sampled_round(rounds, width, filtered=kind == "filtered", bare=bare)
                self.warmed.add((size, graph_kind(kind, bare), width))
                bar.update()
            for size, kind in upkeeps:
                rounds = self.rounds.prefix(size)
                for _ in range(WARM_UP_CALLS):
                    rounds.flush() if kind == "flush" else rounds.catch_up(self._recent_tokens(size))
                self.warmed.add((size, kind, 0))
                bar.update()
            prompt = torch.zeros(1, 1, dtype=torch.long)
            for prompt_context in chunks:
                for _ in range(WARM_UP_CALLS):  # the admission chunk (its scratch caches only)
                    self.admission.prefill(prompt, torch.ones_like(prompt), prompt_context)
                bar.update()
        if self.chooser is not None and plain_with_drafter:
            # the admission chunk's time without the prompts' drafter context over its time with it (at most 1): the
            # chooser's estimate of what a long run of plain rounds saves on each admission
            # (`RoundWidthChooser.admission_ratio`) until it has measured both kinds
            with_context, without = (self._seconds_of(lambda context=context: self.admission.prefill(
                prompt, torch.ones_like(prompt), context)) for context in (True, False))
            self.chooser.admission_ratio = min(1.0, without / with_context)
            for size in sizes:  # the catch-up, which a probe after a long plain run runs first (`step`)
                rounds = self.rounds.prefix(size)
                self.catch_up_seconds[size] = self._seconds_of(lambda: rounds.catch_up(self._recent_tokens(size)))
        self.pending = [0] * self.batch_size
        return len(graphs) + len(upkeeps) + len(chunks)

    def _seconds_of(self, run, calls: int = 8, least: int = 3, budget: float = 0.25) -> float:
        """The median wall-clock seconds of `calls` runs of `run()`, each alone on the device (only `least` once they
        took `budget` seconds: a GPU's graphs take about a millisecond, a CPU's eager forwards up to a second)."""
        device = self.rounds.target.device
        runs = []
        while len(runs) < calls and (len(runs) < least or sum(runs) < budget):
            synchronize(device)
            started = time.perf_counter()
            run()
            synchronize(device)
            runs.append(time.perf_counter() - started)
        return statistics.median(runs)

    def _in_a_long_plain_run(self) -> bool:
        """Whether the last `PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER` rounds were plain: plain rounds are then bare and
        requests join without their prompt's drafter context."""
        return self.plain_rounds_in_a_row >= PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER

    def _recent_tokens(self, rows: int) -> torch.LongTensor:
        """[rows, 2 (γ + 1)]: each of the first `rows` rows' tokens before its anchor, the columns
        `StaticBatchRounds.catch_up` reads (0 where those are padding, and in free rows)."""
        span = self.rounds.catch_up_tokens
        table = [[0] * span for _ in range(rows)]
        for index in self.occupied:
            if index < rows:
                recent = self.owner[index].ids[-span - 1: -1]
                table[index][span - len(recent):] = recent
        return torch.tensor(table, dtype=torch.long, device=self.rounds.anchor.device)

    def _first_tokens(self, rows: list[Row]):
        if self.sampler is None:
            return argmax_last
        return lambda logits: self.sampler.first_tokens(rows, logits)

    def _set_sampling(self, slots: list[int], rows: list[Row] | None) -> None:
        """Rows `slots` take `rows`' sampling settings (None: freed rows, whose device settings stay until the row is
        taken again). The device's per-row temperature / top-k / top-p are written only where they change: for a
        sampled request, or for a greedy one (temperature 1, no top-k / top-p: its argmax under noise of ones) in a
        row that last held a sampled request. Greedy serving writes none."""
        if self.sampler is None:
            return
        if rows is None:
            for slot in slots:
                self.sampled[slot] = self.filtered[slot] = False
            return
        sample, temperature, top_k, top_p = self.sampler.settings(rows)
        changed = [i for i, slot in enumerate(slots) if sample[i] or slot in self._rows_set_to_sample]
        for slot, sampled, k, p in zip(slots, sample, top_k, top_p):
            self.sampled[slot], self.filtered[slot] = sampled, sampled and (k > 0 or p < 1.0)
            (self._rows_set_to_sample.add if sampled else self._rows_set_to_sample.discard)(slot)
        if changed:
            device = self.temperature.device
            index = to_device([slots[i] for i in changed], device, torch.long)
            for values, settings in ((temperature, self.temperature), (top_k, self.top_k), (top_p, self.top_p)):
                settings[index] = to_device([values[i] for i in changed], device, settings.dtype)

    def remove(self, rows: list[Row]) -> None:
        """Frees the rows of finished or cancelled requests (one device write for all of them)."""
        if not rows:
            return
        gone = {id(row) for row in rows}
        freed = [index for index in self.occupied if id(self.owner[index]) in gone]
        if self.chooser is not None:  # (each makes room for an admission: `RoundWidthChooser.admission_per_token`)
            self.chooser.record_finished(sum(len(self.owner[index].ids) - self.owner[index].prompt_len
                                             for index in freed), len(freed))
        for index in freed:
            self.owner[index] = None
            self.pending[index] = 0
        if freed:
            self.rounds.active.index_fill_(0, to_device(freed, self.rounds.active.device, torch.long), 0)
            self._owners_changed()
            self._set_sampling(freed, None)
        if not self.occupied:  # no next round to use a choice made before it (the last round is recorded during the
            self._planned = None  # next one, whenever requests come again: its time may not be known yet)

    def finish_round(self, delivered: float, overhead: float | None = None) -> None:
        """Tells that the last round's tokens were delivered (streamed, checked for stops) at `delivered`
        (`time.perf_counter()`): its time for the chooser ends there rather than when `step` returned; and the
        seconds its caller's step spent around it (`DSparkEngine.step`: before the round and after the delivery,
        admissions left out), the chooser's `overhead`."""
        self._round_ended, self._round_overhead = delivered, overhead

    def _round_seconds(self) -> float:
        """The last round's whole time: from its start to the end of `step` or, later, `finish_round`. The host's work
        on a round's tokens (each row's bookkeeping, streaming, stop checks) comes after the device's and costs every
        round alike; the chooser's times leaving it out undervalued rounds that commit more tokens. (Admissions, and
        whatever runs between the engine's steps, fall outside.)"""
        return self._round_ended - self._last_round_started

    def _record_last_round(self, seconds: float, overhead: float | None = None) -> None:
        if self._unrecorded is not None:
            width, accepted, rows, captured, states, refined, upkeep_seconds = self._unrecorded
            # (the warm-up's catch-up time is a median of its own runs: kept from exceeding the round's, whatever noise)
            self.chooser.record(width, max(seconds - upkeep_seconds, seconds / 10), accepted, rows, captured, states,
                                requests=len(accepted), overhead=overhead, refined=refined)
            self._unrecorded = None

    @torch.no_grad()
    def step(self) -> list[list[int]]:
        """One round for the rows of the smallest prefix in `graph_batch_sizes` that holds every request (requests
        take the lowest free rows); returns the tokens each request's row committed, in `rows` order."""
        occupied = self.occupied
        last = occupied[-1]
        count = self.graph_batch_sizes[bisect.bisect_left(self.graph_batch_sizes, last + 1)]
        rounds = self.rounds.prefix(count)
        planned, self._planned = self._planned, None
        if self.chooser is None:
            verify, self.choice = self.verify, None
        elif planned is not None and planned[0] == self.chooser.group(count, len(occupied)):
            verify, self.choice = planned[1:]
        else:  # the first round, or the round's group (rows, requests) changed since the choice, which the chooser
            # counted as a round of the other group (a refresh due there may be skipped once)
            verify = self.chooser.choose(count, len(occupied))
            self.choice = self.chooser.reason, self.chooser.rates
        # the rows' states after the last round, known only now, may change the width (rounds of a few rows)
        tracked = self.chooser is not None and len(occupied) <= self.chooser.state_rows
        states = None  # (each row's `acceptance_state` before this round, if tracked and known)
        if tracked and not self.drafted_last_round:  # (after a plain round every row's is AFTER_PLAIN)
            states = [AFTER_PLAIN] * len(occupied)
        elif tracked and self._states_current:
            states = [self.acceptance_states[index] for index in occupied]
        refined = False  # (whether `refine` changed the width for the rows' states)
        if states is not None:
            width = self.chooser.refine(verify, states, count)
            if width != verify:
                verify, self.choice, refined = width, (self.chooser.reason, self.chooser.rates), True
        started = time.perf_counter()
        last_round, overhead = self._round_seconds(), self._round_overhead
        self._last_round_started, self._round_overhead = started, None
        # (the whole round: one graph, whose replay needs neither the kernels' context nor the tap: the rounds enter
        # them only where their Python runs)
        with self._part("verify_forward"):
            kind = "greedy" if not any(self.sampled) else "filtered" if any(self.filtered) else "sampled"
            bare = verify == 0 and rounds.drafter is not None and self._in_a_long_plain_run()
            captured = (count, graph_kind(kind, bare), verify) in self.warmed
            self.upkeep = None
            if bare:
                self.behind = True
            elif verify and self.behind:  # the drafter's context from each row's last 2 (γ + 1) tokens
                rounds.catch_up(self._recent_tokens(count))
                self.pending = [self.span if owner is not None else 0 for owner in self.owner]
                self.behind, self.upkeep = False, "catch_up"
            elif rounds.must_flush(verify, max(self.pending)):  # (free rows hold 0)
                rounds.flush()  # the pending context into the drafter cache
                self.pending = [0] * self.batch_size
                self.upkeep = "flush"
            if self.upkeep is not None:
                captured = captured and (count, self.upkeep, 0) in self.warmed
            if kind == "greedy":
                rounds.greedy_round(verify, bare)()
            else:
                self._sampled_round(rounds, verify, filtered=kind == "filtered", bare=bare)
            if self.chooser is not None:  # while the device runs this round: the last round's time and acceptance,
                self._record_last_round(last_round, overhead)  # then the next round's width (if of one group)
                requests = len(occupied)
                self._planned = (self.chooser.group(count, requests), self.chooser.choose(count, requests),
                                 (self.chooser.reason, self.chooser.rates))
                if requests <= self.chooser.state_rows:  # (for `refine` once this round is done)
                    self.chooser.prepare(count, requests)
            # the round's one synchronisation: accepted drafts and the up to verify + 1 tokens committed, per row
            record = rounds.record[:, : verify + 2].tolist()
        committed, accepted_drafts = [], []
        owner, pending = self.owner, self.pending
        for index in occupied:  # (every running row, every round: plain list operations only)
            row, entry = owner[index], record[index]
            accepted = entry[0]
            tokens = entry[1: accepted + 2]
            ids = row.ids
            remaining = row.max_new - len(ids) + row.prompt_len
            row.drafted.append(verify)  # (the round's width; drafts past the row's budget are verified, not used)
            # as the eager rows count them: min(accepted, max(remaining - 1, 0))
            row.accepted.append(accepted if accepted < remaining else remaining - 1 if remaining > 0 else 0)
            ids += tokens
            committed.append(tokens)
            accepted_drafts.append(accepted)
            pending[index] = pending[index] + 1 if verify == 0 else accepted + 1
        self.drafted_last_round = verify > 0
        self.plain_rounds_in_a_row = plain_run_after(self.plain_rounds_in_a_row, verify,
                                                     None if self.choice is None else self.choice[0])
        if self.chooser is not None:  # recorded during the next round (whose width was chosen without it)
            # (a catch-up is the price of leaving a long plain run, not of the width's rounds: a probe from such a
            # run, which pays it, timed with it made drafting look up to twice as dear on an H100 at c = 64)
            upkeep_seconds = self.catch_up_seconds.get(count, 0.0) if self.upkeep == "catch_up" else 0.0
            self._unrecorded = (verify, accepted_drafts, count, captured, states, refined, upkeep_seconds)
            self._states_current = tracked and verify > 0
            if self._states_current:  # (acceptance_state, inline)
                row_states, full = self.acceptance_states, FULL + verify
                for index, accepted in zip(occupied, accepted_drafts):
                    row_states[index] = accepted if accepted < verify else full
        self._round_ended = time.perf_counter()
        return committed

    def _sampled_round(self, rounds: StaticBatchRounds, verify: int, filtered: bool, bare: bool = False) -> None:
        """A round of the sampled graph on `rounds` (a prefix of the rows): noise for the sampled rows (ones for the
        others), then, after a drafting round, `dspark_hf.verify` with each row's settings and `advance`. `filtered`:
        apply the rows' top-k / top-p (another graph); `bare`: a bare plain round (`StaticBatchRounds.greedy_round`)."""
        generator = self.sampler.generator
        device, batch, vocab = self.temperature.device, rounds.pad.shape[0], self.vocab_size
        shape = (batch, vocab) if verify == 0 else (batch, verify, vocab)  # (a round drafts only what it verifies)
        noise = torch.ones(shape, device=device)
        rows = to_device([slot for slot, sampled in enumerate(self.sampled[:batch]) if sampled], device, torch.long)
        noise[rows] = exponential_noise((len(rows), *shape[1:]), generator, device)
        filters = (self.top_k[:batch], self.top_p[:batch]) if filtered else (None, None)
        settings = (self.temperature[:batch], *filters)
        if verify == 0:
            rounds.sampled_round(0, bare)(noise, *settings)
            return
        drafts, probs, logits, features = rounds.sampled_round(verify)(noise, *settings)
        seeds = torch.randint(-(2**62), 2**62, (batch,), generator=generator, device=device)
        result = verify_drafts(drafts.reshape(-1), torch.full((batch,), verify, device=device),
                               logits.reshape(-1, vocab), probs.reshape(-1, vocab),
                               do_sample=to_device(self.sampled[:batch], device),
                               temperature=settings[0], top_k=filters[0], top_p=filters[1], seeds=seeds,
                               max_draft_len=verify)
        rounds.advance(result.num_accepted, result.output_tokens, features)

    def _part(self, name: str):
        return self.profiler.part(name) if self.profiler is not None else nullcontext()
