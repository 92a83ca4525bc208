"""Serving benchmark: DSparkEngine tokens/s vs concurrency for no speculation, fixed γ, a static threshold and the
hardware-aware scheduler; per-request verify lengths; where a round's time goes; padded batch vs transformers' paged
continuous batching.

    # on the H200, one model per run (each run merges its entry into the same JSON; --policies splits a model's
    # policies over several calls, whose results accumulate):
    PYTHONPATH=src python benchmarks/serving.py --model code50m          # fixture + trained drafter; records a trace
    PYTHONPATH=src python benchmarks/serving.py --model qwen3-4b-shape   # random init, acceptance replayed (timing)
    # CPU smoke test with tiny random models (writes to a temp dir; never commit its output)
    PYTHONPATH=src python benchmarks/serving.py --model smoke
    # the engine on static caches (DSparkEngine(static=True), one CUDA graph per round):
    PYTHONPATH=src python benchmarks/serving.py --model code50m --static   # -> results/serving_static_h200.json
    PYTHONPATH=src python benchmarks/serving.py --model qwen3-4b-shape --static   # acceptance replayed (timing)

Models:
- `code50m`: the 50M code fixture (bf16) and its trained DSpark drafter (`drafters/code50m-dspark`), HumanEval
  prompts: real acceptance. Its fixed-γ=7 rounds are recorded as an acceptance trace: per request-round, the
  drafter's 7 confidence logits and how many of the 7 drafts the target accepted.
- `qwen3-4b-shape`: a random-init target with Qwen3-4B's shapes and a random DeepSpec-shaped drafter (5 layers,
  Markov rank 256, confidence head). Random weights accept nothing, so every request-round replays a random
  recorded trace entry: the policy sees the recorded confidences and the round accepts min(l_r, recorded count).
  The target and drafter forwards and the verification run for real at their true shapes: **timing only**. With
  `--static` each row draws a trace entry every round and a round of width v accepts min(v, its count)
  (`StaticTraceReplayer`; the hardware-aware chooser sees those counts).

Protocol (closed loop, c clients): for each concurrency c and policy, `--requests-per-slot` × c requests (at least
`--min-requests`, default 64) with `max_tokens` (`ignore_eos`: every request generates exactly that many) are queued
at once into an engine with
`max_batch_size=c`, so a finished request's slot is refilled from the queue, as in a server under a steady load of c
requests, until the queue runs dry. (With only c requests, speculation would be measured mostly on its tail: rows
finish at different rounds and the last rounds run a nearly empty batch, while plain rows all finish together.)
Request lengths are drawn uniformly from `--max-new-tokens` × (1 ± `--length-spread`), the same draw for every
policy: with equal lengths, plain rows would also finish in lockstep and be refilled by one prefill per wave, where
speculative rows (and any real workload) need many small ones.
A short warm-up run (`--warm-up-tokens`, default 8 tokens, same concurrency and policy) precedes the timed runs.
The timed runs are interleaved: one engine per policy, all fed the same requests, stepped in turn one round at a
time (in a new order every sweep, since a round's time depends on the round before it), each engine's time being
the sum of its own rounds' wall-clock seconds (`run_interleaved`). Every round here is host-bound, and the H200
machine's virtual CPU runs the same Python up to 2x slower for seconds at a time
(`results/host_phases_h200.json`): cells run one after another each met their own phase, and runs of one cell
differed by up to 1.6x. Stepped in turn, every policy sees the same phases. `--sequential` runs the cells one
after another instead, as before 2026-12-01. A cell reports the run with the median tokens/s over `--repeats` runs
(the upper one for an even count; all runs' tokens/s are kept). tokens/s = generated tokens / the engine's seconds;
`steady_tokens_per_second` counts only the rounds that ran all c slots (admission prefills included), i.e. without
the ramp-down after the queue ran dry. Each timed run is a fresh engine, but the hardware-aware policy's
speculation guard lives for the whole benchmark, as in a long-running server: what it measured at the warm-up and
earlier runs carries over (per batch-size bucket). The SPS table of the hardware-aware policy is profiled in the
same run. `hf_paged` is transformers' own continuous batching (paged attention, no speculation, CUDA graphs off
like ours) on the same requests: the padded-vs-paged comparison of docs/serving.md. The summary ratios are minima
over every model and concurrency: `scheduler_vs_best_static_min_ratio` (hardware-aware / best of fixed γ ∈ {1,3,7}
and static threshold) and `scheduler_vs_nospec_min_ratio` (hardware-aware / no speculation); the `steady_` keys are
the same from `steady_tokens_per_second`; the `paired_` keys divide each repeat by the same repeat of the other
policies and take each concurrency's median (`paired_summary`).

`--static` measures `DSparkEngine(static=True)` instead (greedy; policies no_spec, fixed γ ∈ {1, 3, 7} and its
hardware-aware choice among plain rounds and 1, 3 or 7 verified drafts; no static threshold, no trace replay: its
rounds are graphs). Its rounds compile once per shape, so each concurrency keeps one engine per policy for all its
runs, warm-up included (the hardware-aware chooser lives across them). Each engine compiles every round graph it can
run (`DSparkEngine.warm_up`: every row prefix and width, the flush and the admission chunk) before the warm-up run, so
that no compilation falls into a timed run; each cell records that time (`warm_up_seconds`). The timed runs are
interleaved round by round as above (`step_in_turn`; before 2026-12-02 the static cells ran one after another, the
hardware-aware one always last, with its policies sharing one engine). On the H200 a graph takes 10-20 s to compile (a
few seconds when inductor's cache holds the same graph from another engine; 45-60 s for the Qwen3-4B shape, where
`--shared-graphs` runs the drafting policies one after another on the hardware-aware engine, fixed widths pinned, for a
third of the compilations; `--compile-layers-once` traces the target's decoder layer once per graph,
`dspark_hf.generation.compile_layers_once`: 11-22 % less warm-up there), and concurrency c has log2(c) + 1 row
prefixes: `--graph-sizes-per-cell N` keeps the N largest (c, c/2, ...; `static_graph_batch_sizes`), at the price of
more free rows in the rounds of a draining batch.
Every cell records the garbage collector's pauses within its rounds (`gc_ms`, `gc_full`: full collections), since a
process that compiled dozens of graphs holds many Python objects. (torch.compile's `backend="cudagraphs"`, which would
capture the eager kernels and compile faster, fails on the H200 with torch 2.11 at the Triton attention kernel's call:
`BackendCompilerFailed ... cannot extract sympy expressions from {'part_ptr': ...}`; the rounds compile with inductor.)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import gzip
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS, environment, humaneval_prompts, load_target  # noqa: E402

import dspark_hf  # noqa: E402
from dspark_hf.devices import synchronize  # noqa: E402
from dspark_hf.generation import compile_layers_once  # noqa: E402
from dspark_hf.scheduling import SpeculationGuard, SPSTable  # noqa: E402
from dspark_hf.serving import DSparkEngine  # noqa: E402
from dspark_hf.verify import VerifyResult  # noqa: E402

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STATIC = ("fixed_1", "fixed_3", "fixed_7", "static_threshold")
WARM_UP_TOKENS = 8  # new tokens per request of a cell's warm-up run (`--warm-up-tokens`)
QWEN3_MASK_TOKEN_ID = 151669
TRACE = RESULTS / "serving_trace_code50m.json"
# the hardware-aware policy's SPS table is profiled at these sizes (real models)
SPS_PROFILE = dict(batch_tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048), context_length=256, repeats=5)
SHARED_ENGINE = "drafting"  # --shared-graphs: the engine every drafting policy runs on
# --static, only when named in --policies: hardware-aware engines beside the current one, their chooser told no
# overhead (the server's step around a round; as before 2026-12-06), or estimating the widths up to the one walked
# lately from its rounds' strides (`RoundWidthChooser(strides=True)`; the default on 2026-12-06)
ROUND_TIMED = "hardware_aware_round_timed"
STRIDES = "hardware_aware_strides"
STATE_ROWS = "hardware_aware_state_rows_4"  # ... or refining rounds of up to 4 rows (`RoundWidthChooser.state_rows`)
GUARD = SpeculationGuard()  # the hardware-aware engines' guard: one for the whole run, like a long-running server


def policies(threshold: float, gamma_max: int) -> dict[str, dict]:
    table = {"no_spec": dict(policy="none")}
    for gamma in (1, 3, 7):
        if gamma <= gamma_max:
            table[f"fixed_{gamma}"] = dict(policy="fixed", gamma=gamma)
    table["static_threshold"] = dict(policy="static_threshold", threshold=threshold)
    table["hardware_aware"] = table[ROUND_TIMED] = table[STRIDES] = table[STATE_ROWS] = dict(policy="hardware_aware")
    return table


def time_rounds_only(engine: DSparkEngine) -> None:
    """`ROUND_TIMED`: the engine tells its chooser each round's time until its tokens were delivered, and no overhead
    (the step's host work before the round and after the delivery)."""
    finish = engine.runner.finish_round
    engine.runner.finish_round = lambda delivered, overhead=None: finish(delivered)


def with_strides(engine: DSparkEngine) -> None:
    """`STRIDES`: the engine's chooser estimates the widths up to the one walked lately from its rounds' strides."""
    engine.runner.chooser.strides = True


def with_four_state_rows(engine: DSparkEngine) -> None:
    """`STATE_ROWS`: the engine's chooser refines the width of rounds of up to 4 rows by their acceptance states."""
    engine.runner.chooser.state_rows = 4


VARIANTS = {ROUND_TIMED: time_rounds_only, STRIDES: with_strides, STATE_ROWS: with_four_state_rows}


# ---------------------------------------------------------------------------------------------------- models
def tiny_models():
    """A float32 random Qwen3 target and a random DSpark drafter for it (CPU smoke test only)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, num_hidden_layers=4, eos_token_id=2, **common)).eval()
    drafter = dspark_hf.DSparkDraftModel(dspark_hf.DSparkConfig(
        vocab_size=96, num_hidden_layers=2, target_layer_ids=[0, 2], num_target_layers=4, mask_token_id=3,
        block_size=7, markov_rank=8, enable_confidence_head=True, **common)).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (int(n),), generator=generator).tolist()
               for n in torch.randint(4, 16, (16,), generator=generator)]
    return target, drafter, prompts


def load_models(name: str, dtype: torch.dtype, device: str):
    """(target, drafter, prompt token ids) for `code50m` or `qwen3-4b-shape` (prompts from the recorded trace)."""
    from transformers import AutoTokenizer

    target = load_target(name, dtype, device).eval()
    if name == "code50m":
        tokenizer = AutoTokenizer.from_pretrained(target.config._name_or_path)
        drafter = dspark_hf.DSparkDraftModel.from_pretrained(REPO / "drafters" / "code50m-dspark", dtype=dtype)
        prompts = [tokenizer(text)["input_ids"] for text in humaneval_prompts(64)]
    else:
        torch.manual_seed(0)
        config = dspark_hf.DSparkConfig.from_target_config(
            target.config, mask_token_id=QWEN3_MASK_TOKEN_ID, num_hidden_layers=5, block_size=7, markov_rank=256,
            enable_confidence_head=True)
        with torch.device(device):
            drafter = dspark_hf.DSparkDraftModel(config).to(dtype)
        prompts = AcceptanceTrace.load(TRACE).prompts
    return target, drafter.to(device).eval(), prompts


# ---------------------------------------------------------------------------------------------------- traces
class AcceptanceTrace:
    """Full-length rounds of a real run (confidence logits [N, γ], accepted drafts [N]) and the prompts it used.

    `TraceRecorder` collects them from a real run; `TraceReplayer` makes a random-weight engine accept like it."""

    def __init__(self, confidences: torch.Tensor, accepted: torch.Tensor, prompts: list[list[int]]):
        self.confidences, self.accepted, self.prompts = confidences.float(), accepted.long(), prompts

    @classmethod
    def load(cls, path: Path) -> AcceptanceTrace:
        data = json.loads(Path(path).read_text())
        return cls(torch.tensor(data["confidence_logits"]), torch.tensor(data["accepted"]), data["prompts"])

    def save(self, path: Path, limit: int = 4096) -> None:
        data = dict(confidence_logits=[[round(v, 4) for v in row] for row in self.confidences[:limit].tolist()],
                    accepted=self.accepted[:limit].tolist(), prompts=self.prompts,
                    note="code50m fixture + trained DSpark drafter, policy fixed γ=7, greedy, HumanEval prompts")
        Path(path).write_text(json.dumps(data) + "\n")


class EnginePatch:
    """Wraps an engine's `drafter.draft` and its sampler's `verify` while entered. Re-enterable, with its state kept
    between entries: an interleaved cell enters it around each of the engine's rounds, since the engines of one cell
    share the drafter."""

    def __init__(self, engine: DSparkEngine):
        self.runner, self.drafter = engine.runner, engine.drafter

    def __enter__(self):
        original_draft, original_verify = self.drafter.draft, self.runner.sampler.verify
        self._original_verify = original_verify
        self.drafter.draft = functools.wraps(original_draft)(lambda *a, **k: self.draft(original_draft, *a, **k))
        self.runner.sampler.verify = lambda *a: self.verify(original_verify, *a)
        return self

    def __exit__(self, *exc) -> None:
        del self.drafter.draft
        self.runner.sampler.verify = self._original_verify

    def draft(self, original, *args, **kwargs):
        raise NotImplementedError

    def verify(self, original, rows, drafts, lengths, target_logits, draft_logits) -> VerifyResult:
        raise NotImplementedError


class TraceRecorder(EnginePatch):
    """Collects, from an engine running `policy="fixed"` at full γ, each request-round that verified all γ drafts:
    the drafter's confidence logits and how many drafts the target accepted."""

    def __init__(self, engine: DSparkEngine):
        super().__init__(engine)
        self.gamma = engine.drafter.config.num_draft_slots
        self.confidences, self.accepted, self._confidence = [], [], None

    def draft(self, original, *args, **kwargs):
        proposal = original(*args, **kwargs)
        self._confidence = proposal.confidence_logits
        return proposal

    def verify(self, original, rows, drafts, lengths, target_logits, draft_logits) -> VerifyResult:
        result = original(rows, drafts, lengths, target_logits, draft_logits)
        confidence, self._confidence = self._confidence, None
        if confidence is not None and confidence.shape[1] == self.gamma:
            full = (lengths == self.gamma).nonzero().squeeze(1)
            self.confidences.append(confidence[full.to(confidence.device)].float().cpu())
            self.accepted.append(result.num_accepted[full.to(result.num_accepted.device)].cpu())
        return result

    def trace(self, prompts: list[list[int]]) -> AcceptanceTrace | None:
        if not self.confidences:
            return None
        return AcceptanceTrace(torch.cat(self.confidences), torch.cat(self.accepted), prompts)


class TraceReplayer(EnginePatch):
    """Makes an engine with meaningless (random) weights accept like a recorded run: each request-round draws one
    trace entry, the policy sees its confidences, and the round accepts min(l_r, its count). Timing only."""

    def __init__(self, trace: AcceptanceTrace, engine: DSparkEngine, seed: int = 0):
        super().__init__(engine)
        self.generator = torch.Generator().manual_seed(seed)
        self.device = next(engine.drafter.parameters()).device
        self.confidences, self.accepted = trace.confidences.to(self.device), trace.accepted
        self._index = None

    def draft(self, original, *args, **kwargs):
        proposal = original(*args, **kwargs)
        self._index = torch.randint(len(self.accepted), (proposal.tokens.shape[0],), generator=self.generator)
        proposal.confidence_logits = self.confidences[self._index.to(self.device), :proposal.tokens.shape[1]]
        return proposal

    def verify(self, original, rows, drafts, lengths, target_logits, draft_logits) -> VerifyResult:
        real = original(rows, drafts, lengths, target_logits, draft_logits)  # paid for, then overridden
        if self._index is None:  # no draft this round (every row's budget was spent)
            return real
        index, self._index = self._index, None
        out_device = real.output_tokens.device
        count = torch.minimum(lengths, self.accepted[index]).to(out_device)
        bonus = real.output_tokens.gather(1, real.num_accepted[:, None])
        tokens = torch.cat([drafts.to(out_device), bonus], dim=1)
        columns = torch.arange(tokens.shape[1], device=out_device)[None, :]
        tokens = torch.where(columns < count[:, None], tokens, bonus)
        tokens = torch.where(columns <= count[:, None], tokens, torch.full_like(tokens, -1))
        return VerifyResult(num_accepted=count, output_tokens=tokens)


class StaticTraceReplayer:
    """`TraceReplayer` for the static engine, whose rounds are graphs: entered around each of the engine's rounds,
    it draws one trace entry per row, and a drafting round of width v accepts min(v, its count)
    (`StaticBatchRounds.replay_acceptance`, set up here, before the engine's first round). Timing only.
    `restart(seed)` before each run: the k-th round of every run with that seed then draws the same entries, so two
    policies of the same width accept alike (with one stream, policies sharing an engine drew different ones)."""

    def __init__(self, trace: AcceptanceTrace, engine: DSparkEngine, seed: int = 0):
        self.counts = engine.runner.rounds.replay_acceptance()
        self.accepted = trace.accepted.to(self.counts.device)
        self.generator = torch.Generator().manual_seed(seed)

    def restart(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def __enter__(self):
        index = torch.randint(len(self.accepted), (len(self.counts),), generator=self.generator)
        self.counts.copy_(self.accepted[index.to(self.counts.device)])
        return self

    def __exit__(self, *exc) -> None:
        pass


# ---------------------------------------------------------------------------------------------------- measuring
def make_engine(target, drafter, concurrency: int, setting: dict, sps_table, **options) -> DSparkEngine:
    kwargs = dict(setting, **options)
    if kwargs.get("policy") == "hardware_aware":
        kwargs["sps_table"] = sps_table
        kwargs.setdefault("speculation_guard", GUARD)
    return DSparkEngine(target, drafter if kwargs.get("policy") != "none" else None, max_batch_size=concurrency,
                        seed=0, **kwargs)


def warm_up_args(args: argparse.Namespace) -> argparse.Namespace:
    """A cell's arguments for its warm-up run: `--warm-up-tokens` new tokens per request (default `WARM_UP_TOKENS`)."""
    return argparse.Namespace(**{**vars(args), "max_new_tokens": getattr(args, "warm_up_tokens", WARM_UP_TOKENS)})


def request_lengths(count: int, args) -> list[int]:
    """Each request's exact number of new tokens: `--max-new-tokens` spread uniformly by ± `--length-spread` (the
    same lengths for every policy at one concurrency)."""
    if args.length_spread <= 0:
        return [args.max_new_tokens] * count
    low = max(1, round(args.max_new_tokens * (1 - args.length_spread)))
    high = max(low, round(args.max_new_tokens * (1 + args.length_spread)))
    return torch.randint(low, high + 1, (count,), generator=torch.Generator().manual_seed(count)).tolist()


def request_count(concurrency: int, args) -> int:
    """A cell's requests: `--requests-per-slot` × c, at least `--min-requests` (so that a run at low concurrency
    lasts long enough to be timed)."""
    return max(concurrency * args.requests_per_slot, getattr(args, "min_requests", 0))


def add_requests(engine: DSparkEngine, prompts, concurrency: int, args) -> list:
    """The cell's requests (`request_count`, lengths from `request_lengths`), queued at once."""
    lengths = request_lengths(request_count(concurrency, args), args)
    return [engine.add_request(prompts[i % len(prompts)], max_tokens=n, temperature=0.0, ignore_eos=True)
            for i, n in enumerate(lengths)]


def drive(engine: DSparkEngine, prompts, concurrency: int, args) -> tuple[list, float]:
    handles = add_requests(engine, prompts, concurrency, args)
    synchronize(engine.target.device)
    start = time.perf_counter()
    engine.run()
    synchronize(engine.target.device)
    return handles, time.perf_counter() - start


def steady_throughput(log: list[dict], concurrency: int) -> float | None:
    """Tokens/s over the rounds that ran all `concurrency` slots (admission prefills included): the load the cell
    is named after, without the ramp-down once the queue is empty, where rows finishing at different rounds leave
    speculative batches part-empty (plain rows finish together)."""
    full = [entry for entry in log if entry["batch"] == concurrency]
    seconds = sum(entry["seconds"] for entry in full)
    return sum(len(e["accepted"]) + sum(e["accepted"]) for e in full) / seconds if seconds > 0 else None


def patch_for(engine: DSparkEngine, trace, record: bool, seed: int):
    """The engine's trace replayer (random-weight models), recorder, or nothing."""
    if trace is not None and engine.drafter is not None:
        return TraceReplayer(trace, engine, seed=seed)
    return TraceRecorder(engine) if record else contextlib.nullcontext()


def cell_result(engine: DSparkEngine, handles: list, seconds: float, concurrency: int) -> dict:
    log = engine.round_log
    if len(log) == log.maxlen:
        raise RuntimeError(f"the run took {log.maxlen} rounds or more, more than the engine's round log keeps")
    tokens = sum(len(h.tokens) for h in handles)
    accepted = [n for entry in log for n in entry["accepted"]]
    return dict(
        concurrency=concurrency, requests=len(handles), generated_tokens=tokens, seconds=seconds,
        tokens_per_second=tokens / seconds, steady_tokens_per_second=steady_throughput(log, concurrency),
        rounds=len(log), round_ms=1e3 * seconds / max(1, len(log)),
        round_ms_median=1e3 * statistics.median(e["seconds"] for e in log) if log else None,
        round_ms_max=1e3 * max(e["seconds"] for e in log) if log else None,
        # where a round's time goes: admitting requests, the draft + verify round, the rest (delivering tokens,
        # freeing rows, the driver loop)
        admit_ms_per_round=1e3 * sum(e["admit_seconds"] for e in log) / max(1, len(log)),
        step_ms_per_round=1e3 * sum(e["step_seconds"] for e in log) / max(1, len(log)),
        step_ms_median=1e3 * statistics.median(e["step_seconds"] for e in log) if log else None,
        other_ms_per_round=1e3 * (seconds - sum(e["seconds"] for e in log)) / max(1, len(log)),
        tau=(sum(accepted) + len(accepted)) / max(1, len(accepted)),
        verify_length_histogram={str(k): v for k, v in sorted(Counter(n for e in log for n in e["verify"]).items())},
        mean_batch=sum(e["batch"] for e in log) / max(1, len(log)),
        mean_cache_width=sum(e["width"] for e in log) / max(1, len(log)),
        mean_hole_fraction=sum(e["holes"] for e in log) / max(1, len(log)),
        plain_round_fraction=sum(not e["speculative"] for e in log) / max(1, len(log)),
        # (static engines) requests that joined after a run of plain rounds, without their prompt's drafter context
        admitted_without_prompt_context=getattr(engine.runner, "admitted_without_prompt_context", None),
        guard=None if engine.runner.guard is None
        else {str(k): v for k, v in engine.runner.guard.summary().items()},
    )


def run_cell(target, drafter, prompts, concurrency: int, setting: dict, args, sps_table, trace=None,
             recorded: list | None = None) -> dict:
    """One policy's cell, alone: its requests from first to last, timed by the wall clock."""
    engine = make_engine(target, drafter, concurrency, setting, sps_table)
    patch = patch_for(engine, trace, recorded is not None, seed=concurrency)
    with patch:
        handles, seconds = drive(engine, prompts, concurrency, args)
    trace_part = patch.trace(prompts) if isinstance(patch, TraceRecorder) else None
    if trace_part is not None:
        recorded.append(trace_part)
    return cell_result(engine, handles, seconds, concurrency)


class GCPauses:
    """Seconds Python's garbage collector has paused the process so far (`gc.callbacks`), and full collections."""

    def __init__(self):
        self.seconds, self.full, self._started = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.full += info["generation"] == 2


GC_PAUSES = GCPauses()


def step_in_turn(engines: dict[str, DSparkEngine], patches: dict | None = None, seed: int = 0
                 ) -> tuple[dict[str, float], dict[str, dict]]:
    """Steps `engines` (each with its requests queued) in turn one round at a time, in their order and then in a new
    order each sweep (`random.Random(seed)`), until all have finished. A round's time depends on the round before it
    (on the H200, fixed γ = 7's rounds right after a plain round took 1.0-3.7 % less than their median, those after a
    γ = 3 round 0.2-0.9 % more): in a fixed or rotated order each engine would keep the same neighbours, which
    favoured the engine after no speculation.
    Returns each engine's seconds (the sum of its own rounds' wall-clock time, each ending with the device idle), the
    garbage collector's pauses within them (`gc_ms`, `gc_full`) and the graphs dynamo compiled in them
    (`compiled_graphs`: 0 once the graphs are warm)."""
    seconds = dict.fromkeys(engines, 0.0)
    pauses = {name: dict(gc_ms=0.0, gc_full=0, compiled_graphs=0) for name in engines}
    compiled = torch._dynamo.utils.counters["stats"]
    device = next(iter(engines.values())).target.device
    order, shuffle = list(engines), random.Random(seed).shuffle
    while order:
        for name in list(order):
            engine = engines[name]
            if not engine.has_unfinished():
                order.remove(name)
                continue
            with (patches or {}).get(name) or contextlib.nullcontext():
                synchronize(device)
                gc_seconds, gc_full, graphs = GC_PAUSES.seconds, GC_PAUSES.full, compiled["unique_graphs"]
                start = time.perf_counter()
                engine.step()
                synchronize(device)
                seconds[name] += time.perf_counter() - start
                pauses[name]["gc_ms"] += 1e3 * (GC_PAUSES.seconds - gc_seconds)
                pauses[name]["gc_full"] += GC_PAUSES.full - gc_full
                pauses[name]["compiled_graphs"] += compiled["unique_graphs"] - graphs
        shuffle(order)
    return seconds, pauses


def run_interleaved(target, drafter, prompts, concurrency: int, settings: dict[str, dict], args, sps_table,
                    trace=None, record: str | None = None, round_logs: dict[str, list] | None = None
                    ) -> tuple[dict[str, dict], AcceptanceTrace | None]:
    """Every policy's cell at once, one engine per policy, stepped in turn one round at a time (in a new order each
    sweep); each engine's time is the sum of its own rounds' wall-clock seconds (each round
    ends with the device idle). A host whose speed drifts over seconds then slows every policy alike, where cells
    run one after another each meet their own phase. `record`: the policy whose full-γ rounds are recorded;
    `round_logs`, when given, receives each engine's round log."""
    engines = {name: make_engine(target, drafter, concurrency, setting, sps_table)
               for name, setting in settings.items()}
    patches = {name: patch_for(engine, trace, name == record, seed=concurrency) for name, engine in engines.items()}
    handles = {name: add_requests(engine, prompts, concurrency, args) for name, engine in engines.items()}
    seconds, pauses = step_in_turn(engines, patches)
    recorder = patches.get(record)
    recorded = recorder.trace(prompts) if isinstance(recorder, TraceRecorder) else None
    if round_logs is not None:
        round_logs.update({name: list(engine.round_log) for name, engine in engines.items()})
    return {name: cell_result(engine, handles[name], seconds[name], concurrency) | pauses[name]
            for name, engine in engines.items()}, recorded


def run_paged(target, prompts, concurrency: int, args) -> dict:
    """transformers' own continuous batching (paged KV cache, no speculation) on the same requests. The manager is
    started and warmed up before the clock starts (as our engine's warm-up run)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    count = request_count(concurrency, args)
    inputs, lengths = [prompts[i % len(prompts)] for i in range(count)], request_lengths(count, args)
    config = GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(max_requests_per_batch=concurrency, use_cuda_graph=False)
    manager = target.init_continuous_batching(config, batching)
    manager.start()
    try:
        def complete(ids: list[str]) -> int:
            tokens, waiting = 0, set(ids)
            while waiting:
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError("transformers' continuous batching stopped answering")
                if result.is_finished() and result.request_id in waiting:
                    if result.error is not None:
                        raise RuntimeError(result.error)
                    waiting.discard(result.request_id)
                    tokens += len(result.generated_tokens)
            return tokens

        complete(manager.add_requests(inputs[:concurrency], max_new_tokens=4))  # warm-up
        synchronize(target.device)
        start = time.perf_counter()
        tokens = complete([manager.add_request(ids, max_new_tokens=n) for ids, n in zip(inputs, lengths)])
        synchronize(target.device)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    if tokens < sum(lengths):
        raise RuntimeError(f"continuous batching returned {tokens} of {sum(lengths)} tokens")
    return dict(concurrency=concurrency, requests=count, generated_tokens=tokens, seconds=seconds,
                tokens_per_second=tokens / seconds)


def round_breakdown(target, drafter, prompts, concurrency: int, setting: dict, args, sps_table, trace) -> dict:
    """ms per round in each part (`DSparkEngine(profile_rounds=True)`: prefill, draft backbone, Markov + sampling,
    scheduler, verify forward, verification, bookkeeping). Synchronises around each part, so the total is a bit
    slower than an unprofiled round."""
    engine = make_engine(target, drafter, concurrency, setting, sps_table, profile_rounds=True)
    with patch_for(engine, trace, False, seed=1):
        drive(engine, prompts, concurrency, args)
    return dict(concurrency=concurrency, policy=setting.get("policy"), rounds=engine.runner.profiler.rounds,
                ms_per_round={k: round(v, 3) for k, v in engine.round_profile().items()})


def run_eager_cells(target, drafter, prompts, concurrency: int, chosen: dict[str, dict], args, sps_table, trace,
                    recorded: list[AcceptanceTrace]) -> dict[str, list[dict]]:
    """Each policy's warm-up run at this shape (kernel selection, Triton specialisation), then `--repeats` runs of
    every policy, interleaved (or one after another with `--sequential`); the first run of fixed γ = 7 is recorded
    as an acceptance trace (into `recorded`) when no trace is replayed."""
    for setting in chosen.values():
        run_cell(target, drafter, prompts, concurrency, setting, warm_up_args(args), sps_table, trace)
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for repeat in range(args.repeats):
        record = "fixed_7" if drafter.config.num_draft_slots == 7 and trace is None and repeat == 0 else None
        if args.sequential:
            for name, setting in chosen.items():
                runs[name].append(run_cell(target, drafter, prompts, concurrency, setting, args, sps_table, trace,
                                           recorded if name == record else None))
            continue
        cells, trace_part = run_interleaved(target, drafter, prompts, concurrency, chosen, args, sps_table, trace,
                                            record)
        for name, cell in cells.items():
            runs[name].append(cell)
        if trace_part is not None:
            recorded.append(trace_part)
    return runs


COMPACT_COLUMNS = ["ended_ms", "rows", "admitted", "verify", "accepted", "admit_ms", "step_ms", "upkeep",
                   "deliver_ms", "choice", "rates", "outside_ms"]


def compact_round_log(log: list[dict], origin: float) -> list[list]:
    """One round per entry: [ms since `origin` at its end, rows, requests admitted, verified drafts (the widest
    row's), drafts accepted in all, admission ms, draft + verify ms, the drafter-context upkeep the round ran first
    ("flush", "catch_up" or None), ms from its end until its tokens were delivered, why the chooser chose the round's
    width (`RoundWidthChooser.reason`; None without a chooser), the rates it compared then ({width: tokens per second
    and row}, or None), ms of the engine's step outside the admission, round and delivery (before the round and after
    the delivery; None if not logged)]."""
    return [[round(1e3 * (e["ended"] - origin), 3), e["batch"], e["admitted"], max(e["verify"], default=0),
             sum(e["accepted"]), round(1e3 * e["admit_seconds"], 4), round(1e3 * e["step_seconds"], 4), e["upkeep"],
             round(1e3 * (e["delivered"] - e["ended"]), 4), *compact_choice(e.get("choice")),
             round(1e3 * e["outside"], 4) if "outside" in e else None] for e in log]


def compact_choice(choice: tuple | None) -> list:
    """[reason, {width: rate rounded to 0.1}] of a round's `choice`, [None, None] without one."""
    if choice is None:
        return [None, None]
    reason, rates = choice
    return [reason, None if rates is None else {str(width): round(rate, 1) for width, rate in rates.items()}]


def run_static_cells(target, drafter, prompts, concurrency: int, names: list[str], args,
                     round_logs: dict | None = None, trace: AcceptanceTrace | None = None) -> dict[str, list[dict]]:
    """`--static`: one engine per policy, kept for this concurrency; each compiles its graphs (`warm_up`), then a
    warm-up run and `--repeats` timed runs of all policies, stepped in turn (`step_in_turn`: the first engine rotating
    from run to run, then a new order each sweep), or with `--sequential` one after another (in a rotating order).
    `--shared-graphs`: the drafting policies share the hardware-aware engine (its graphs of every width; fixed γ runs
    it with the width pinned, `set_policy`), one after another; no speculation keeps its own engine.
    `round_logs`, when given, receives every run's round logs (`compact_round_log`), warm-up run included, by policy.
    `trace`: the speculative engines accept as it says (`StaticTraceReplayer`, restarted with one seed for every
    policy's run of a repeat: the k-th round of each draws the same entries; random-weight models, timing only)."""
    longest = max(map(len, prompts)) + max(request_lengths(request_count(concurrency, args), args))
    # --dynamic-batch: dynamo's automatic dynamic shapes: a width's first two row prefixes compile (the second with a
    # symbolic batch size, which the larger ones reuse), and CUDA graphs are still recorded per prefix
    compile_rounds = dict(mode="reduce-overhead", dynamic=None) if args.dynamic_batch else None
    graph_sizes = {max(1, concurrency >> k) for k in range(args.graph_sizes_per_cell)} or None
    shared = args.shared_graphs
    engine_of = {name: SHARED_ENGINE if shared and name != "no_spec" else name for name in names}
    engines, warm_up_seconds, patches = {}, {}, {}
    for key in dict.fromkeys(engine_of.values()):  # every graph of every policy, before any run
        policy = "hardware_aware" if key == SHARED_ENGINE else key
        gamma = fixed_gamma(policy)
        engines[key] = engine = DSparkEngine(
            target, drafter if policy != "no_spec" else None, static=True,
            policy="fixed" if gamma is not None else "none" if policy == "no_spec" else "hardware_aware",
            gamma=gamma, max_batch_size=concurrency,
            max_model_len=longest + 8, static_compile=compile_rounds,
            admission_batch=args.admission_batch if args.admission_batch == "auto" else min(args.admission_batch,
                                                                                           concurrency),
            static_graph_batch_sizes=graph_sizes,
            static_admission_rows=args.admission_rows)
        if args.eager_admission_from is not None:
            engine.runner.eager_admission_from = args.eager_admission_from
        if key in VARIANTS:
            VARIANTS[key](engine)
        if trace is not None and policy != "no_spec":  # (before the graphs are captured: they read its buffer)
            patches[key] = StaticTraceReplayer(trace, engine, seed=concurrency)
        chooser = engine.runner.chooser
        widths = {fixed_gamma(name) for name in names if engine_of[name] == key and name != policy}  # (pinned)
        started = time.perf_counter()
        engine.warm_up(widths=sorted(widths | set(chooser.widths)) if chooser is not None else None)
        warm_up_seconds[key] = time.perf_counter() - started
        print(f"c={concurrency} {key}: warm_up() {warm_up_seconds[key]:.0f} s", flush=True)  # (a cut call's clue)
    choosers = {key: engine.runner.chooser for key, engine in engines.items()}
    patches = {name: patches[engine_of[name]] for name in names if engine_of[name] in patches}

    def select(name: str) -> DSparkEngine:
        """The engine `name` runs on, set to its policy (a shared engine's width pinned, or its chooser back)."""
        engine = engines[engine_of[name]]
        if engine_of[name] != name:
            if fixed_gamma(name) is not None:
                engine.runner.set_policy(verify=fixed_gamma(name))
            else:
                engine.runner.set_policy(chooser=choosers[engine_of[name]])
        return engine

    def measured(name: str, engine: DSparkEngine, handles: list, seconds: float, pauses: dict) -> dict:
        cell = cell_result(engine, handles, seconds, concurrency) | pauses
        cell["warm_up_seconds"] = warm_up_seconds[engine_of[name]]
        if engine.runner.chooser is not None:
            # per group of rounds: "rows" where more than half the rows held a request, else "rows/requests"
            cell["chooser"] = {str(rows) if requests == rows else f"{rows}/{requests}":
                               {str(width): times for width, times in widths.items()}
                               for (rows, requests), widths in engine.runner.chooser.summary().items()}
            chooser = engine.runner.chooser  # the admission milliseconds each width's committed token brings about
            cell["chooser_admission"] = {"ratio": chooser.admission_ratio, "ms_per_token": {
                str(width): 1e3 * chooser.admission_per_token(width) for width in chooser.widths}}
        return cell

    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(-1, args.repeats):  # -1: the warm-up run
        run_args = warm_up_args(args) if repeat < 0 else args
        first = repeat % len(names)  # the policy that goes first rotates from run to run
        order = names[first:] + names[:first]
        origin = time.perf_counter()
        handles, cells, logs = {}, {}, {}
        replay_seed = concurrency * 1000 + repeat + 1  # (the same draws for every policy's run of this repeat)
        if args.sequential or shared:
            for name in order:
                if name in patches:
                    patches[name].restart(replay_seed)
                engine = select(name)
                handles[name] = add_requests(engine, prompts, concurrency, run_args)
                engine.round_log.clear()
                seconds, pauses = step_in_turn({name: engine}, patches)
                cells[name] = measured(name, engine, handles[name], seconds[name], pauses[name])
                logs[name] = compact_round_log(engine.round_log, origin)
        else:
            handles = {name: add_requests(engines[name], prompts, concurrency, run_args) for name in names}
            for patch in patches.values():
                patch.restart(replay_seed)
            for engine in engines.values():
                engine.round_log.clear()
            seconds, pauses = step_in_turn({name: engines[name] for name in order}, patches, seed=repeat + 1)
            for name in names:
                cells[name] = measured(name, engines[name], handles[name], seconds[name], pauses[name])
                logs[name] = compact_round_log(engines[name].round_log, origin)
        if round_logs is not None:
            for name in names:
                round_logs.setdefault(name, []).append(logs[name])
        if repeat < 0:
            continue
        tokens = {name: [handle.tokens for handle in handles[name]] for name in names}
        for name in names:
            if name != "no_spec" and "no_spec" in tokens and trace is None:  # (bf16: graphs of other shapes may
                # break argmax ties; replayed acceptance commits the target's tokens for drafts it did not compare)
                cells[name]["matched_no_spec"] = statistics.fmean(a == b for a, b in zip(tokens[name],
                                                                                         tokens["no_spec"]))
            runs[name].append(cells[name])
    return runs


def fixed_gamma(name: str) -> int | None:
    """γ of a fixed-γ policy's name ("fixed_3": 3); None for any other policy."""
    return int(name.removeprefix("fixed_")) if name.startswith("fixed_") else None


def static_engine_label(args: argparse.Namespace) -> str:
    shapes = "symbolic batch" if args.dynamic_batch else "one compilation per row prefix"
    prefixes = (f"the {args.graph_sizes_per_cell} largest of c, c/2, ... rows" if args.graph_sizes_per_cell
                else "power-of-two row prefixes")
    engines = ("the drafting policies on one engine (fixed widths pinned), no speculation on its own"
               if args.shared_graphs else "one engine per policy")
    return (f"static (DSparkEngine(static=True), inductor, {shapes}, {prefixes}, "
            f"admission_batch {args.admission_batch}, admission_rows {args.admission_rows}, {engines})")


# ---------------------------------------------------------------------------------------------------- report
def merge_cells(earlier: dict[str, list[dict]], new: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Per policy, cells by concurrency: a new cell replaces an earlier one at the same concurrency (runs split over
    several calls by `--policies` or `--concurrency` accumulate)."""
    merged = {}
    for name in {**earlier, **new}:
        cells = {c["concurrency"]: c for c in earlier.get(name, [])} | {c["concurrency"]: c for c in new.get(name, [])}
        merged[name] = [cells[c] for c in sorted(cells)]
    return merged


def hardware_aware_ratios(by: dict[str, dict[int, Any]], divide: Callable, best: Callable = max
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per concurrency (`by`: policy -> concurrency -> measurement), hardware-aware's measurement divided by the best
    static policy's (`best` of theirs) and by no speculation's; `divide(hardware_aware, other)`."""
    static_ratio, nospec_ratio = {}, {}
    for level, hw in sorted(by.get("hardware_aware", {}).items()):
        static = [by[p][level] for p in STATIC if level in by.get(p, {})]
        if static:
            static_ratio[str(level)] = divide(hw, best(static))
        if level in by.get("no_spec", {}):
            nospec_ratio[str(level)] = divide(hw, by["no_spec"][level])
    return static_ratio, nospec_ratio


def summarize(models: dict[str, dict], key: str = "tokens_per_second", prefix: str = "") -> dict:
    """The issue's ratios from whole-run tokens/s; with `key="steady_tokens_per_second", prefix="steady_"` the
    same from full-load rounds."""
    vs_static, vs_nospec, per_model = [], [], {}
    for name, entry in models.items():
        by = {policy: {c["concurrency"]: c[key] for c in rows if c.get(key)}
              for policy, rows in entry["results"].items()}
        static_ratio, nospec_ratio = hardware_aware_ratios(by, lambda hw, other: hw / other)
        per_model[name] = dict(scheduler_vs_best_static=static_ratio, scheduler_vs_nospec=nospec_ratio)
        vs_static += static_ratio.values()
        vs_nospec += nospec_ratio.values()
    return {f"{prefix}scheduler_vs_best_static_min_ratio": min(vs_static) if vs_static else None,
            f"{prefix}scheduler_vs_nospec_min_ratio": min(vs_nospec) if vs_nospec else None,
            f"{prefix}ratios_by_model": per_model}


def paired_summary(models: dict[str, dict]) -> dict:
    """The same ratios run by run: hardware-aware's tokens/s in each repeat over the best static policy's and over no
    speculation's in the same repeat (`tokens_per_second_runs`; the policies of one repeat run stepped in turn, so a
    slow phase of the host hits them alike), and the smallest over concurrencies of each concurrency's median. A
    noisy repeat moves a ratio of medians taken policy by policy; it moves the median of paired ratios less."""
    vs_static, vs_nospec, per_model = [], [], {}
    for name, entry in models.items():
        by = {policy: {c["concurrency"]: c["tokens_per_second_runs"] for c in rows if c.get("tokens_per_second_runs")}
              for policy, rows in entry["results"].items()}
        hardware_aware = by.get("hardware_aware", {})
        for level, hw in list(hardware_aware.items()):  # (a concurrency whose policies ran other repeats: left out)
            if any(len(runs.get(level, hw)) != len(hw) for runs in by.values()):
                del hardware_aware[level]
        static_ratio, nospec_ratio = hardware_aware_ratios(
            by, lambda hw, other: [h / o for h, o in zip(hw, other)], best=lambda runs: list(map(max, zip(*runs))))
        per_model[name] = dict(scheduler_vs_best_static=static_ratio, scheduler_vs_nospec=nospec_ratio)
        vs_static += map(statistics.median, static_ratio.values())
        vs_nospec += map(statistics.median, nospec_ratio.values())
    return {"paired_scheduler_vs_best_static_min_median": min(vs_static, default=None),
            "paired_scheduler_vs_nospec_min_median": min(vs_nospec, default=None),
            "paired_ratios_by_model": per_model}


def plot(models: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.5 * len(models)), squeeze=False)
    for (name, entry), (left, right) in zip(models.items(), axes):
        series = dict(entry["results"])
        if entry.get("hf_paged"):
            series["hf_paged (no spec)"] = entry["hf_paged"]
        for policy, rows in series.items():
            style = dict(linestyle="--") if policy.startswith("hf_paged") else {}
            left.plot([r["concurrency"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o",
                      label=policy, **style)
        left.set_xscale("log", base=2)
        left.set_yscale("log")
        left.set_xlabel("concurrency")
        left.set_ylabel("generated tokens / s")
        left.set_title(f"{name}: throughput vs concurrency" + (" (timing only)" if entry.get("replayed") else ""))
        left.legend(fontsize=7)
        for row in series.get("hardware_aware", []):
            hist = {int(k): v for k, v in row["verify_length_histogram"].items()}
            total = sum(hist.values()) or 1
            keys = sorted(hist)
            right.plot(keys, [hist[k] / total for k in keys], marker=".", label=f"c={row['concurrency']}")
        right.set_xlabel("verify length l_r (drafted tokens verified)")
        right.set_ylabel("fraction of request-rounds")
        right.set_title(f"{name}: hardware-aware per-request verify lengths")
        right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["code50m", "qwen3-4b-shape", "smoke"], required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--requests-per-slot", type=int, default=4, help="requests queued per unit of concurrency")
    parser.add_argument("--min-requests", type=int, default=64,
                        help="at least this many requests per cell (a cell of 4 requests at c = 1 lasted 0.1 s on the "
                             "H200, too short to time; before 2026-12-03 there was no minimum); 0: none")
    parser.add_argument("--eager-admission-from", type=int, default=None,
                        help="--static: requests of similar lengths joining together from this many on are prefilled "
                             "in one eager forward instead of admission chunks (StaticRows.eager_admission_from; "
                             "default 8 x --admission-rows, before 2026-12-03 always 8)")
    parser.add_argument("--length-spread", type=float, default=0.5,
                        help="request lengths uniform in max-new-tokens × (1 ± spread); 0: all equal")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell")
    parser.add_argument("--sequential", action="store_true",
                        help="run each policy's cell on its own, one after another (before 2026-12-01: the default), "
                             "instead of all policies' engines stepped in turn")
    parser.add_argument("--threshold", type=float, default=0.5, help="static-threshold policy's confidence threshold")
    parser.add_argument("--policies", nargs="*", help="subset of: no_spec fixed_1 fixed_3 fixed_7 static_threshold "
                        "hardware_aware (default: all)")
    parser.add_argument("--breakdown-at", type=int, nargs="*", default=[1, 32, 256], help="none: skip the breakdown")
    parser.add_argument("--no-paged", dest="paged", action="store_false", help="skip transformers' paged baseline")
    parser.add_argument("--static", action="store_true",
                        help="DSparkEngine(static=True): one CUDA graph per round (see the docstring)")
    parser.add_argument("--dynamic-batch", action="store_true",
                        help="--static: compile the rounds with a symbolic batch size (two compilations per width "
                             "instead of one per row prefix and width; CUDA graphs still per prefix). On the H200 each "
                             "compilation took 26-39 s against 10-13 s: --graph-sizes-per-cell cuts more")
    parser.add_argument("--graph-sizes-per-cell", type=int, default=0,
                        help="--static: the rows a round may run are the N largest of c, c/2, c/4, ... at concurrency "
                             "c (DSparkEngine's static_graph_batch_sizes; fewer graphs to compile, draining batches "
                             "run more free rows); default 0: every power of two")
    parser.add_argument("--warm-up-tokens", type=int, default=WARM_UP_TOKENS,
                        help="new tokens per request of each cell's warm-up run (the hardware-aware chooser explores "
                             "every width there and lives on into the timed runs; with 8, its first refreshes fall "
                             "into the first timed run)")
    parser.add_argument("--admission-batch", type=lambda value: value if value == "auto" else int(value),
                        default="auto",
                        help="--static: DSparkEngine's admission_batch (waiting requests join once this many rows are "
                             "free; capped at the concurrency), or auto (the static engine's default: joins held while "
                             "they cost more than the idle rows, serving.admission.JoinGate)")
    parser.add_argument("--admission-rows", type=int, default=1,
                        help="--static: DSparkEngine's static_admission_rows (requests joining together run their "
                             "admission chunks as one graph of this many rows; capped at the concurrency)")
    parser.add_argument("--shared-graphs", action="store_true",
                        help="--static: the drafting policies run one after another on one engine, the hardware-aware "
                             "one's (its graphs of every width, fixed widths pinned), instead of one engine each: "
                             "about a third of the compilations (a Qwen3-4B-shaped engine's took 89-163 s at c = 1)")
    parser.add_argument("--compile-layers-once", action="store_true",
                        help="--static: mark the target's decoder layers as one nested compile region first "
                             "(dspark_hf.generation.compile_layers_once: the layer compiles once per graph, not once "
                             "per layer)")
    parser.add_argument("--round-logs", help="--static: a .json.gz path for every run's round logs (compact_round_log)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/serving_h200.json, "
                        "serving_static_h200.json with --static; a temp dir for smoke)")
    args = parser.parse_args()
    if args.static:  # each concurrency's engines compile their rounds anew (per width, kind and row prefix)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)

    trace = None
    if args.model == "smoke":
        args.concurrency = [c for c in args.concurrency if c <= 4] or [1]
        args.breakdown_at = [c for c in args.breakdown_at if c <= 4] or [2]
        args.max_new_tokens, args.requests_per_slot = min(args.max_new_tokens, 8), 2
        target, drafter, prompts = tiny_models()
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="serving-smoke-")) / "serving_smoke.json"
        table = dict(batch_tokens=(1, 4, 16, 64), context_length=16, repeats=2)
    else:
        target, drafter, prompts = load_models(args.model, getattr(torch, args.dtype), args.device)
        out = Path(args.out) if args.out else RESULTS / ("serving_static_h200.json" if args.static
                                                         else "serving_h200.json")
        table = SPS_PROFILE
        if args.model == "qwen3-4b-shape":
            trace = AcceptanceTrace.load(TRACE)
    if args.compile_layers_once:
        compile_layers_once(target)
    sps_table = None  # the static engine measures its own round times
    if not args.static:
        with torch.inference_mode():
            sps_table = SPSTable.profile(target, model_name=args.model, progress=False, **table)
    gamma_max = drafter.config.num_draft_slots

    results: dict[str, list[dict]] = {}
    all_round_logs: dict[str, dict] = {}  # --round-logs: concurrency -> policy -> runs (the warm-up run first)
    recorded: list[AcceptanceTrace] = []
    breakdown, paged = [], []

    def save() -> None:  # after every policy, so that a run cut short by a time limit keeps what it measured
        payload = json.loads(out.read_text()) if out.exists() else dict(benchmark="serving", models={})
        earlier = payload["models"].get(args.model, {})  # runs split over several calls (--policies) accumulate
        payload["models"][args.model] = dict(
            environment=environment(), replayed=trace is not None,
            settings=dict(dtype="float32" if args.model == "smoke" else args.dtype, max_new_tokens=args.max_new_tokens,
                          temperature=0.0, ignore_eos=True, threshold=args.threshold, concurrency=args.concurrency,
                          requests_per_slot=args.requests_per_slot, min_requests=args.min_requests,
                          eager_admission_from=args.eager_admission_from, repeats=args.repeats,
                          protocol="sequential" if args.sequential or args.shared_graphs else "interleaved",
                          engine=static_engine_label(args) if args.static else "eager",
                          compile_layers_once=args.compile_layers_once,
                          length_spread=args.length_spread,
                          prompts="random ids" if args.model == "smoke" else "HumanEval (code50m tokenizer)",
                          acceptance="replayed from serving_trace_code50m.json (timing only)" if trace is not None
                          else "real", sps_table=sps_table.to_dict() if sps_table is not None else None),
            results=merge_cells(earlier.get("results", {}), results),
            hf_paged=[p for p in paged if "error" not in p] or earlier.get("hf_paged", []),
            hf_paged_error=next((p["error"] for p in paged if "error" in p), earlier.get("hf_paged_error")),
            round_breakdown=breakdown or earlier.get("round_breakdown", []),
        )
        payload.update(summarize(payload["models"]))
        payload.update(summarize(payload["models"], "steady_tokens_per_second", "steady_"))
        payload.update(paired_summary(payload["models"]))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")
        plot(payload["models"], out.with_suffix(".png"))
        print({k: payload[k] for k in ("scheduler_vs_best_static_min_ratio", "scheduler_vs_nospec_min_ratio",
                                       "steady_scheduler_vs_best_static_min_ratio",
                                       "steady_scheduler_vs_nospec_min_ratio",
                                       "paired_scheduler_vs_best_static_min_median",
                                       "paired_scheduler_vs_nospec_min_median")},
              flush=True)

    chosen = {name: setting for name, setting in policies(args.threshold, gamma_max).items()
              if (not args.policies or name in args.policies) and not (args.static and name == "static_threshold")
              and (name not in VARIANTS or args.static and args.policies)}
    with torch.inference_mode():
        # concurrency outside, policies inside: the policies compared at one concurrency run minutes apart at most
        for concurrency in args.concurrency:
            if args.static:
                logs = all_round_logs.setdefault(str(concurrency), {}) if args.round_logs else None
                runs = run_static_cells(target, drafter, prompts, concurrency, list(chosen), args, logs, trace)
                if args.round_logs:
                    with gzip.open(args.round_logs, "wt") as file:
                        json.dump(dict(environment=environment(), columns=COMPACT_COLUMNS,
                                       runs=all_round_logs), file)
            else:
                runs = run_eager_cells(target, drafter, prompts, concurrency, chosen, args, sps_table, trace,
                                       recorded)
            for name, cells in runs.items():
                cell = sorted(cells, key=lambda c: c["tokens_per_second"])[len(cells) // 2]
                cell = dict(cell, tokens_per_second_runs=[c["tokens_per_second"] for c in cells],
                            round_ms_max_runs=[c["round_ms_max"] for c in cells])
                results.setdefault(name, []).append(cell)
                print(f"{args.model} {name:>16} c={concurrency:<4} {cell['tokens_per_second']:9.1f} tok/s "
                      f"(runs {' '.join(f'{t:.0f}' for t in cell['tokens_per_second_runs'])}; "
                      f"full load {cell['steady_tokens_per_second'] or 0:.0f})  "
                      f"tau={cell['tau']:.2f}  round={cell['round_ms']:.1f} ms "
                      f"(median {cell['round_ms_median']:.1f}, max {cell['round_ms_max']:.0f}; admission "
                      f"{cell['admit_ms_per_round']:.2f}, draft + verify {cell['step_ms_per_round']:.2f}, rest "
                      f"{cell['other_ms_per_round']:.2f})  "
                      f"holes={cell['mean_hole_fraction']:.2f}  plain rounds={cell['plain_round_fraction']:.2f}  "
                      f"(max round per run {' '.join(f'{t:.0f}' for t in cell['round_ms_max_runs'])} ms; "
                      f"graphs compiled {sum(c['compiled_graphs'] for c in cells)})", flush=True)
            if recorded:
                merged = AcceptanceTrace(torch.cat([t.confidences for t in recorded]),
                                         torch.cat([t.accepted for t in recorded]), prompts)
                merged.save(TRACE if args.model == "code50m" else out.with_name("serving_trace_smoke.json"))
            save()
        for c in args.breakdown_at if not args.static else ():  # a static round is one graph: no parts
            for name in ("no_spec", "hardware_aware"):
                setting = policies(args.threshold, gamma_max)[name]
                breakdown.append(round_breakdown(target, drafter, prompts, c, setting, args, sps_table, trace))
    save()
    # transformers' manager (its own thread, no_grad); skipped with --static: serving_h200.json holds that comparison
    for concurrency in args.concurrency if args.paged and not args.static else ():
        try:
            paged.append(run_paged(target, prompts, concurrency, args))
        except Exception as error:  # noqa: BLE001 - recorded, the rest of the benchmark stands
            paged.append(dict(concurrency=concurrency, error=f"{type(error).__name__}: {error}"[:300]))
            break
        print(f"{args.model} {'hf_paged':>16} c={concurrency:<4} {paged[-1]['tokens_per_second']:9.1f} tok/s",
              flush=True)
    save()
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
