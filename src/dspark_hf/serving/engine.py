"""`DSparkEngine`: many requests on one target + DSpark drafter, continuous batching, per-request verify lengths.

    engine = DSparkEngine(target, drafter, tokenizer=tok, policy="hardware_aware", sps_table=table)
    handle = engine.add_request("Write a haiku", max_tokens=64, temperature=0.7)
    for token in handle.stream(): ...            # tokens as they are accepted
    engine.add_request([{"role": "user", "content": "hi"}], temperature=0)   # chat messages, greedy
    outputs = engine.run()                       # drive until every request finished

Each round (`step()`): cancelled requests leave, waiting requests join (one prefill forward for all of them), the
drafter drafts for every running request in one forward, the policy picks each request's verify length, ONE
target forward verifies every request's ragged proposal, and `dspark_hf.verify.verify` accepts (Triton on GPU).
Requests are rows of a padded batch whose rejected slots are masked cache holes (see `generation/ragged.py` and
docs/serving.md for the design and what is left to measure on the GPU).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedModel
from transformers.generation.stopping_criteria import StopStringCriteria

from ..attention_backends import decoding_attention
from ..generation.policy import resolve_policy
from ..generation.profiling import RoundProfiler
from ..generation.speculative_rows import Row, SpeculativeRows, check_batchable_target, ragged_drafts, ragged_rows
from ..generation.static_rows import StaticRows
from ..generation.target_features import check_drafter_fits_target
from ..models import DSparkDraftModel
from ..scheduling import RoundWidthChooser, SchedulerPolicy, SpeculationGuard, SPSTable, get_policy
from ..tensor_ops import to_device
from ..verify import VerifyResult, verify
from ..verify.reference import processed_scores
from .admission import FreeRowsGate, JoinGate
from .requests import Request, RequestOutput, SamplingParams, prompt_token_ids


class RequestSampler:
    """Per-request temperature / top-k / top-p (verify's own processing) with the engine's random generator."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    @staticmethod
    def settings(rows: list[Row]) -> tuple[list[bool], list[float], list[int], list[float]]:
        """Per row, on the host: (sampled?, temperature, top-k (0: off), top-p); greedy rows: (False, 1.0, 0, 1.0)."""
        params = [row.tag.params for row in rows]
        sample = [not p.greedy for p in params]
        return (sample, [p.temperature if s else 1.0 for p, s in zip(params, sample)],
                [max(p.top_k, 0) if s else 0 for p, s in zip(params, sample)],
                [float(p.top_p) if s else 1.0 for p, s in zip(params, sample)])

    @classmethod
    def params(cls, rows: list[Row], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`settings` as tensors on `device`."""
        sample, temperature, top_k, top_p = cls.settings(rows)
        return (to_device(sample, device), to_device(temperature, device, torch.float32),
                to_device(top_k, device, torch.long), to_device(top_p, device, torch.float32))

    @staticmethod
    def _all_greedy(rows: list[Row]) -> bool:
        return all(row.tag.params.greedy for row in rows)

    def _choose(self, rows, logits):
        tokens = logits.argmax(dim=-1)
        if self._all_greedy(rows):
            return tokens, logits
        sample, temperature, top_k, top_p = self.params(rows, logits.device)
        processed = logits.clone()
        index = sample.nonzero().squeeze(1)
        filtered = processed_scores(logits[index], temperature[index], top_k[index], top_p[index])
        processed[index] = filtered
        drawn = torch.multinomial(filtered.softmax(dim=-1), 1, generator=self.generator).squeeze(1)
        tokens[index] = drawn
        return tokens, processed

    def select(self, rows, drafted, logits):
        return self._choose(rows, logits)

    def first_tokens(self, rows, logits):
        return self._choose(rows, logits)[0]

    def verify(self, rows, drafts, lengths, target_logits, draft_logits) -> VerifyResult:
        device = target_logits.device
        flat_drafts, flat_logits = ragged_drafts(drafts, lengths), ragged_rows(target_logits, lengths)
        if self._all_greedy(rows):  # no processing, no noise (the torch path skips its sort and RNG)
            return verify(flat_drafts, lengths.to(device), flat_logits, None, do_sample=False)
        sample, temperature, top_k, top_p = self.params(rows, device)
        probs = (ragged_drafts(draft_logits, lengths).softmax(dim=-1) if draft_logits is not None
                 else target_logits.new_zeros(0, target_logits.shape[-1]))
        seeds = torch.randint(-(2**62), 2**62, (len(rows),), generator=self.generator, device=self.generator.device)
        return verify(flat_drafts, lengths.to(device), flat_logits, probs, do_sample=sample, temperature=temperature,
                      top_k=top_k, top_p=top_p, seeds=seeds.to(device))


ROUND_LOG_ROUNDS = 16384  # rounds `DSparkEngine.round_log` keeps (one dict with two tuples of batch size per round)
STATIC_WIDTHS = (0, 1, 3)  # with the drafter's γ: the numbers of verified drafts the static hardware-aware policy
# chooses among (one compiled graph each)


def _static_rows(target, drafter, policy, gamma, threshold, sps_table, guard, max_batch_size, max_model_len,
                 compile_rounds, graph_batch_sizes, admission_rows: int, sampler: RequestSampler) -> StaticRows:
    """`DSparkEngine(static=True)`'s runner: policy "none", "fixed" (None: "fixed"; `gamma` drafts or all) or
    "hardware_aware" (a `RoundWidthChooser` over plain rounds, 1, 3 and γ verified drafts, on measured round times)."""
    if max_model_len is None:
        raise ValueError("DSparkEngine(static=True) needs max_model_len: it sizes the static caches.")
    if threshold is not None or sps_table is not None or guard:
        raise ValueError("DSparkEngine(static=True) takes no threshold, sps_table or speculation_guard: its "
                         "hardware-aware policy measures its own round times (plain rounds included).")
    if isinstance(policy, SchedulerPolicy) or policy not in (None, "none", "no_speculation", "fixed", "fixed_length",
                                                             "hardware_aware"):
        raise ValueError(f"DSparkEngine(static=True) runs policy 'none', 'fixed' or 'hardware_aware', not {policy!r}.")
    if drafter is None or policy in ("none", "no_speculation"):
        drafter = None
    slots = drafter.config.num_draft_slots if drafter is not None else 0
    if gamma is not None and (policy not in (None, "fixed", "fixed_length") or not 1 <= gamma <= slots):
        raise ValueError(f"gamma applies to policy='fixed', between 1 and the drafter's {slots} draft slots; "
                         f"got {gamma}.")
    chooser = None
    if policy == "hardware_aware" and drafter is not None:
        chooser = RoundWidthChooser(tuple(width for width in (*STATIC_WIDTHS, slots) if width <= slots))
    compile_rounds = target.device.type == "cuda" if compile_rounds is None else compile_rounds
    return StaticRows(target, drafter, max_batch_size, max_model_len, compile=compile_rounds, verify=gamma,
                      chooser=chooser, sampler=sampler, graph_batch_sizes=graph_batch_sizes,
                      admission_rows=admission_rows)


def _speculative_rows(target, drafter, policy, gamma, threshold, sps_table, guard, compact_threshold,
                      sampler: RequestSampler) -> SpeculativeRows:
    """The eager engine's runner, with its policy and speculation guard (default: on for the hardware-aware
    policies; a guard without an SPS table gets the policy's)."""
    speculate, scheduler = _engine_policy(policy, drafter, threshold, sps_table, gamma)
    if guard is None:
        guard = scheduler is not None and scheduler.name.startswith("hardware_aware")
    if guard is True:
        guard = SpeculationGuard()
    if guard and guard.sps_table is None and scheduler is not None:
        guard.sps_table = scheduler.params.get("sps_table")
    return SpeculativeRows(target, drafter if speculate else None, sampler, scheduler,
                           drafter.config.sts_temperatures if drafter is not None else None,
                           compact_threshold=compact_threshold, guard=guard or None)


def _engine_policy(policy, drafter, threshold, sps_table, gamma) -> tuple[bool, SchedulerPolicy | None]:
    """(speculate, policy) from the engine's arguments."""
    if drafter is None or policy in ("none", "no_speculation"):
        return False, None
    if isinstance(policy, SchedulerPolicy):
        return True, policy
    if policy in ("fixed", "fixed_length") or (policy is None and gamma is not None):
        return True, get_policy("fixed", gamma=gamma) if gamma is not None else None
    if gamma is not None:
        raise ValueError("gamma applies to policy='fixed' only.")
    if isinstance(sps_table, (str, Path)):
        sps_table = SPSTable.load(sps_table)
    # policy=None (and no threshold/table): resolve_policy falls back to the drafter's generation_config defaults
    config = type("Arguments", (), {"dspark_policy": policy, "dspark_threshold": threshold,
                                    "dspark_sps_table": sps_table})()
    return True, resolve_policy(config, drafter)


class DSparkEngine:
    """Serves many requests with DSpark speculative decoding (see the module docstring).

    Args:
        target: the causal LM (full attention on every layer).
        drafter: a `DSparkDraftModel` for it, or None for plain batched decoding.
        tokenizer: needed for text / chat prompts, stop strings and `RequestOutput.text`.
        policy: verify-length policy: "fixed" (every drafted token, or `gamma` of them), "static_threshold"
            (`threshold`), "hardware_aware" / "hardware_aware_async" (`sps_table`), a `SchedulerPolicy`, "none"
            (no speculation: the drafter is not run), or None: the drafter's `generation_config` defaults
            (`dspark_policy`, `dspark_threshold`, `dspark_sps_table`; "fixed" when it has none), as in generate().
        max_batch_size: requests decoded at once; the others wait (FIFO) and join between rounds.
        admission_batch: waiting requests join once at least this many rows are free (or as many as are waiting, or
            none is running): fewer, larger admission prefills, for rows left idle a few rounds; 1: at once.
            "auto": `serving.admission.JoinGate` holds a join until the free rows' idle time reaches the stall it
            would cost the running requests, from measured join and round times, or until a whole admission set
            (`static_admission_rows` rows; the eager engine's whole batch) is free; then whole sets join. Default:
            "auto" with `static` (on the H200 1.04-2.1x the tokens/s of joining at once, docs/serving.md), 1 without
            (the eager engine was not measured with "auto").
        max_model_len: context limit (default: the target's `max_position_embeddings`).
        seed: seeds the engine's random generator (draft sampling and verification noise).
        default_sampling: defaults for `add_request`'s sampling arguments (e.g. `{"temperature": 0}`).
        speculation_guard: plain rounds instead of speculative ones while drafting does not pay at the current
            batch size, measured online (`scheduling.SpeculationGuard`). Default (None): on for the hardware-aware
            policies, off for the others (a fixed γ means every round drafts). True / False / a guard instance (one
            without an SPS table gets the policy's).
        profile_rounds: time each round's parts (`round_profile()`); synchronises the device at every part boundary,
            so it slows the engine down a little.
        static: run the rows on static caches (`generation.static_rows.StaticRows`): a request takes a free row of
            a `max_batch_size` × `max_model_len` cache (give `max_model_len`; a request joins in 64-token chunks,
            one CUDA graph, `generation.static_admission.ChunkedAdmission`), every round verifies the same number
            of drafts of every row in one forward, one CUDA graph per number with `static_compile` (default: on
            CUDA), greedy or, when any running request samples, sampled. Policies: "none", "fixed" (all γ drafts,
            or `gamma`), "hardware_aware": each round, plain or 1, 3 or γ verified drafts, whichever commits the
            most tokens per second by measured round times and acceptance (`scheduling.RoundWidthChooser`; no SPS
            table, no guard). Experimental.
        static_graph_batch_sizes: with `static`, the numbers of rows a round may run: each round runs the smallest
            that holds every request (`max_batch_size` is always one). Default: the powers of two below
            `max_batch_size`. Each size is one more set of graphs to compile; with fewer, a draining batch's rounds
            run more free rows.
        static_admission_rows: with `static`, how many requests of similar lengths join in one set of chunks (one
            graph of that many rows, at most `max_batch_size`; the rows fewer requests leave run copies); a group of
            8 × that many or more prefills in one eager forward instead. Default 1. On a small, launch-bound model
            several cost about what one does (the 50M fixture on the H200 served c = 128-256 best with 16); on a large
            one each row costs its compute.
    """

    def __init__(self, target: PreTrainedModel, drafter: DSparkDraftModel | None = None, tokenizer=None, *,
                 policy: str | SchedulerPolicy | None = None, gamma: int | None = None, threshold: float | None = None,
                 sps_table: SPSTable | str | None = None, max_batch_size: int = 64, max_model_len: int | None = None,
                 seed: int = 0, default_sampling: dict | None = None, compact_threshold: float = 0.5,
                 speculation_guard: bool | SpeculationGuard | None = None, profile_rounds: bool = False,
                 static: bool = False, static_compile: bool | dict | None = None,
                 admission_batch: int | Literal["auto"] | None = None,
                 static_graph_batch_sizes: Iterable[int] | None = None, static_admission_rows: int = 1):
        check_batchable_target(target)
        if drafter is not None:
            check_drafter_fits_target(drafter.config, target)
            drafter.share_target_weights(target)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        if admission_batch is None:
            admission_batch = "auto" if static else 1
        if admission_batch != "auto" and not (isinstance(admission_batch, int)
                                              and 1 <= admission_batch <= max_batch_size):
            raise ValueError(f"admission_batch must be \"auto\" or between 1 and max_batch_size ({max_batch_size}), "
                             f"got {admission_batch!r}.")
        if (static_graph_batch_sizes is not None or static_admission_rows != 1) and not static:
            raise ValueError("static_graph_batch_sizes and static_admission_rows apply to DSparkEngine(static=True).")
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.generator = torch.Generator(device=target.device).manual_seed(seed)
        sampler = RequestSampler(self.generator)
        if static:
            self.runner = _static_rows(target, drafter, policy, gamma, threshold, sps_table, speculation_guard,
                                       max_batch_size, max_model_len, static_compile, static_graph_batch_sizes,
                                       static_admission_rows, sampler)
        else:
            self.runner = _speculative_rows(target, drafter, policy, gamma, threshold, sps_table, speculation_guard,
                                            compact_threshold, sampler)
        self.join_gate = FreeRowsGate(admission_batch) if admission_batch != "auto" else JoinGate(
            self.runner.admission.rows if static else max_batch_size)
        text = target.config.get_text_config()
        self.vocab_size = text.vocab_size
        self.max_model_len = max_model_len or getattr(text, "max_position_embeddings", None)
        self.max_batch_size = max_batch_size
        self.default_sampling = SamplingParams.build({}, dict(default_sampling or {}))
        self._default_max_given = bool({"max_tokens", "max_new_tokens"} & set(default_sampling or {}))
        eos = target.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        if profile_rounds:
            self.runner.profiler = RoundProfiler(target.device)
        self.requests: dict[str, Request] = {}  # the unfinished ones (a request leaves when it finishes)
        self.waiting: deque[Request] = deque()
        self._cancels: list[Request] = []  # requests whose cancel was asked since the last round (waiting or running)
        # per round: batch, requests admitted, verify lengths, accepted, drafted?, width, holes, seconds (admission and
        # round), admit_seconds (the admitted requests' prefill and first tokens), step_seconds (the draft + verify
        # round), ended (time.perf_counter() at the round's end), upkeep (static engines: the drafter-context upkeep
        # the round ran first, "flush" or "catch_up"; else None), choice (static engines with a chooser: why its width
        # was chosen and the rates then compared, `StaticRows.choice`; else None), delivered (time.perf_counter() once
        # its tokens are streamed and checked for stops), outside (the step's seconds before the round and after the
        # delivery, admissions left out); the last ROUND_LOG_ROUNDS rounds (a server runs hundreds of rounds a second)
        self.round_log: deque[dict] = deque(maxlen=ROUND_LOG_ROUNDS)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop_criteria: dict[tuple[str, ...], StopStringCriteria] = {}
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt, *, request_id: str | None = None, on_token=None, **sampling) -> Request:
        """Queues a request and returns its handle. `prompt`: text, chat messages or token ids. Sampling arguments:
        temperature, top_k, top_p, do_sample, max_tokens (or max_new_tokens), stop, stop_token_ids, ignore_eos.
        `on_token(request_id, tokens)` is called with each round's new tokens. A bad request raises ValueError
        here and leaves every other request untouched."""
        defaults = {k: getattr(self.default_sampling, k) for k in ("temperature", "top_k", "top_p", "do_sample",
                                                                    "max_tokens", "stop", "stop_token_ids",
                                                                    "ignore_eos")}
        params = SamplingParams.build(defaults, sampling)
        ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        if self.max_model_len is not None:
            if len(ids) >= self.max_model_len:
                raise ValueError(f"The prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                                 "(max_model_len), so nothing can be generated. Shorten the prompt.")
            asked = self._default_max_given or sampling.get("max_tokens") or sampling.get("max_new_tokens")
            if not asked:  # the default budget: whatever the context leaves
                params = dataclasses.replace(params, max_tokens=min(params.max_tokens, self.max_model_len - len(ids)))
            if len(ids) + params.max_tokens > self.max_model_len:
                raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                                 f"of {self.max_model_len} tokens (max_model_len); lower max_tokens.")
        criteria = None
        if params.stop:
            if self.tokenizer is None:
                raise ValueError("Stop strings need DSparkEngine(..., tokenizer=...).")
            criteria = self._stop_criteria.get(params.stop)
            if criteria is None:
                criteria = self._stop_criteria[params.stop] = StopStringCriteria(self.tokenizer, list(params.stop))
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        with self._lock:
            rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
            if rid in self.requests:
                raise ValueError(f"request_id {rid!r} is already in use.")
            request = Request(self, rid, ids, params, stop_ids, criteria, on_token)
            self.requests[rid] = request
            self.waiting.append(request)
        return request

    def cancel(self, request_id: str) -> None:
        """Cancels an unfinished request: it stops at the next round boundary (its stream ends, finish_reason
        "cancelled")."""
        with self._lock:
            request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"Unknown request_id {request_id!r}.")
        request.cancel()

    def _ask_cancel(self, request: Request) -> None:
        """Marks `request` (unfinished) for the next round to cancel (`Request.cancel`). The round reads only the
        requests marked so: scanning every running and waiting request for a flag cost every round about 0.1 µs per
        request, thousands of them while a burst waits."""
        with self._lock:
            if not request.cancel_requested and not request.finished:
                request.cancel_requested = True
                self._cancels.append(request)

    def decode(self, tokens: list[int]) -> str | None:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else None

    @property
    def num_running(self) -> int:
        return len(self.runner.rows)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.runner.rows)

    # ------------------------------------------------------------------ the loop
    def _deliver(self, rows: list[Row], committed: list[list[int]]) -> list[Row]:
        """Emits each row's new tokens up to its first stop; returns the rows that finished."""
        done = []
        for row, tokens in zip(rows, committed):
            request: Request = row.tag
            if request.stop_criteria is None and len(row.ids) - row.prompt_len < row.max_new \
                    and request.stop_ids.isdisjoint(tokens):  # (most rows, most rounds: no stop among the tokens)
                request._emit(tokens)
                continue
            start = len(row.ids) - len(tokens)
            emitted, reason = [], None
            for index in range(start, len(row.ids)):
                token = row.ids[index]
                emitted.append(token)
                if token in request.stop_ids:
                    reason = "stop"
                elif request.stop_criteria is not None and bool(
                        request.stop_criteria(torch.tensor([row.ids[: index + 1]]), None).any()):
                    reason = "stop"
                elif index - row.prompt_len + 1 >= row.max_new:
                    reason = "length"
                if reason is not None:
                    del row.ids[index + 1:]
                    break
            request._emit(emitted)
            if reason is not None:
                request._finish(reason)
                done.append(row)
        return done

    def step(self) -> bool:
        """One round: retire cancelled requests, admit waiting ones, draft + verify every running request.
        Returns False when there was nothing to do."""
        entered = time.perf_counter()
        with self._lock:
            asked, self._cancels = self._cancels, []
            cancelled = [request.row for request in asked if request.row is not None]  # the running ones
            for request in asked:
                if request.row is None and not request.finished:  # still waiting (a finished one has no row either)
                    self.waiting.remove(request)
                    request._finish("cancelled")
            admitted = []
            free = self.max_batch_size - len(self.runner.rows) + len(cancelled)
            joining = self.join_gate.rows_to_join(free, len(self.waiting), self.max_batch_size - free)
            while self.waiting and len(admitted) < joining:
                admitted.append(self.waiting.popleft())
        for row in cancelled:
            row.tag._finish("cancelled")
        self.runner.remove(cancelled)
        if not admitted and not self.runner.rows:
            return bool(cancelled)
        with decoding_attention(), self.runner.profiler.round() if self.runner.profiler is not None else nullcontext():
            ran = self._round(admitted)
        if ran:  # the rest of this step: all of it but the admissions, the round and the delivery
            entry = self.round_log[-1]
            entry["outside"] = time.perf_counter() - entered - entry["seconds"] - (entry["delivered"] - entry["ended"])
            if isinstance(self.runner, StaticRows):  # the round's time for its width chooser ends with the delivery;
                # the rest is its overhead (every width's: whatever runs between steps is out)
                self.runner.finish_round(entry["delivered"], entry["outside"])
        return True

    def _round(self, admitted: list[Request]) -> bool:
        """Admits `admitted` (one prefill), then one draft + verify round for every running request. Returns whether
        a round ran (not if every admitted request finished at its first token)."""
        started = time.perf_counter()
        if admitted:
            rows = []
            for request in admitted:
                request.row = Row(ids=list(request.prompt_ids), prompt_len=len(request.prompt_ids),
                                  max_new=request.params.max_tokens, stop_ids=request.stop_ids, tag=request)
                rows.append(request.row)
            self.runner.remove(self._deliver(rows, self.runner.add(rows)))
        admitted_at = now = time.perf_counter()
        ran = bool(self.runner.rows)
        if ran:
            rows = list(self.runner.rows)
            committed = self.runner.step()
            state = self.runner.state
            now = time.perf_counter()
            # Tuples of ints (and then their dict) leave the garbage collector's lists: a full log of lists at 256
            # rows cost every full collection 70-130 ms on the development CPU, of tuples 0.1 ms.
            verify, accepted = tuple([row.drafted[-1] for row in rows]), tuple([row.accepted[-1] for row in rows])
            static = isinstance(self.runner, StaticRows)
            entry = dict(batch=len(rows), admitted=len(admitted), verify=verify, accepted=accepted,
                         speculative=self.runner.drafted_last_round, width=state.width, holes=state.hole_fraction(),
                         seconds=now - started, admit_seconds=admitted_at - started, step_seconds=now - admitted_at,
                         ended=now, upkeep=self.runner.upkeep if static else None,
                         choice=self.runner.choice if static else None)
            self.round_log.append(entry)
            done = self._deliver(rows, committed)
            entry["delivered"] = time.perf_counter()  # (streaming and stop checks done)
            self.runner.remove(done)
        self.join_gate.record(len(admitted), admitted_at - started, now - admitted_at)
        return ran

    def round_profile(self) -> dict[str, float]:
        """Milliseconds per round in each part (`generation.profiling.PARTS`) and in all, over the rounds so far.
        Needs `profile_rounds=True`."""
        if self.runner.profiler is None:
            raise ValueError("round_profile() needs DSparkEngine(..., profile_rounds=True).")
        return self.runner.profiler.report()

    def warm_up(self, widths: Iterable[int] | None = None, sampled: bool = False, progress: bool = True,
                freeze_gc: bool = True) -> int:
        """Static engine: before the first request, runs each round graph that rounds verifying `widths` drafts
        (default: the policy's) can need, per row prefix, greedy (and with `sampled`, sampled), the flush and the
        admission chunk, as often as compiling and capturing it takes (`StaticRows.warm_up`), so that with
        `static_compile` no compilation or CUDA graph capture stalls serving later.
        Returns the number of graphs run; the eager engine has none (0).

        With `freeze_gc` (default), every object alive afterwards is moved out of the garbage collector's reach
        (`gc.collect()`, then `gc.freeze()`, as vLLM and SGLang do after start-up): a process that compiled dozens of
        graphs holds many Python objects, and on the H200 a full collection over them paused serving for about a
        second. Frozen objects are still freed when their last reference goes; `gc.unfreeze()` undoes it."""
        if not isinstance(self.runner, StaticRows):
            return 0
        if self.has_unfinished() or self.running_in_background:
            raise RuntimeError("warm_up() runs before the first request and before start().")
        with self._lock:
            graphs = self.runner.warm_up(widths, sampled, progress)
        if freeze_gc:
            gc.collect()
            gc.freeze()
        return graphs

    def run(self) -> dict[str, RequestOutput]:
        """Steps until every request has finished; returns the outputs, by id, of the requests that were unfinished
        when it started or were added while it ran (earlier ones: their handles' `result()`)."""
        seen = dict(self.requests)
        while self.has_unfinished():
            seen.update(self.requests)
            self.step()
        return {rid: request.output() for rid, request in seen.items()}

    # ------------------------------------------------------------------ background loop
    @property
    def running_in_background(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, idle_sleep: float = 0.001) -> None:
        """Runs `step()` in a background thread until `stop()`; `add_request` / `cancel` / `stream` stay usable."""
        if self.running_in_background:
            return
        self._stop_event.clear()

        def loop():
            while not self._stop_event.is_set():
                if not self.step():
                    time.sleep(idle_sleep)

        self._thread = threading.Thread(target=loop, name="DSparkEngine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
