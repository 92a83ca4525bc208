"""Diagnostics behind the serving benchmark's noise and costs (code50m fixture; timing only).

    PYTHONPATH=src python benchmarks/serving_diagnostics.py host-phases OUT.json
    PYTHONPATH=src python benchmarks/serving_diagnostics.py plain-rounds [--concurrency 256] > OUT.txt
    PYTHONPATH=src python benchmarks/serving_diagnostics.py round-logs OUT.json [--concurrency 32 256]
    PYTHONPATH=src python benchmarks/serving_diagnostics.py static-acceptance OUT.json [--concurrency 1] [--settings S]
    python benchmarks/serving_diagnostics.py round-log-report OUT.json[.gz]   # reads the file only; no GPU

host-phases: does the host change speed over time? Ten rows per setting, each timing a pure Python loop
(`sum(range(300000))`), 2000 in-place adds on a 1-element device tensor, and one DSparkEngine cell at c = 1 (64 new
tokens) with no speculation and with fixed γ = 7 (median round ms), under torch's default threads, one thread, and one
thread pinned to core 2 (`results/host_phases_h200.json`).
plain-rounds: do the plain rounds of the hardware-aware engine (a guard that never drafts: target features are still
captured for the drafter) cost more than no-speculation rounds? Cells of 2c requests (32-96 new tokens) alternate
between the two engines, then one more of each runs under cProfile
(`results/serving_diagnostics/plain_round_profile_h200.txt`).
round-logs: where do the hardware-aware engine's seconds go? The benchmark's interleaved cells (64 new tokens ± 50 %,
2 requests per slot, after its warm-up) of no speculation, fixed γ = 7, the hardware-aware policy and `ha_plain`,
twice per concurrency; every engine's round log and every speculative round the guard was told about are written out.
static-acceptance: why did the static engine accept fewer drafts on the GPU at c = 1 (tau 2.27 against the eager
engine's 3.92 and its own 4.67 on the CPU in float32)? The benchmark's cell of 2c requests with fixed γ = 7 on the
eager engine (bf16, float32) and on the static engine in bf16 and float32, with rounds compiled (after `warm_up`) and
not; per setting tau and, for the static engine, the share of drafting rounds' drafts equal to a float32 eager
drafter's proposal from the request's whole committed context (`tests/test_static_batch.py`'s check). `--settings`
also offers compiled bf16 without CUDA graphs and with the attention kernel on one cache slice. Answer (2026-12-02,
results/serving_diagnostics/README.md): inductor's tracing of the split-KV kernel launches; fixed since.
round-log-report: per run of a round-logs file, tokens/s relative to no speculation, and each engine's seconds split
into plain and speculative rounds with and without an admission (prefill of new requests), as count × mean ms.
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import gzip
import io
import itertools
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
import serving  # noqa: E402
from common import environment  # noqa: E402

from transformers.cache_utils import DynamicCache  # noqa: E402

from dspark_hf.devices import synchronize  # noqa: E402
from dspark_hf.generation import static_attention  # noqa: E402
from dspark_hf.models import TargetLayerTap  # noqa: E402
from dspark_hf.scheduling import SpeculationGuard, SPSTable  # noqa: E402
from dspark_hf.serving import DSparkEngine  # noqa: E402

SETTINGS = {"nospec": dict(policy="none"), "fixed7": dict(policy="fixed", gamma=7),
            "ha_plain": dict(policy="hardware_aware")}


CELL = argparse.Namespace(max_new_tokens=64, requests_per_slot=2, length_spread=0.5)  # 32-96 new tokens, 2c requests


class NeverDraft(SpeculationGuard):
    """A guard that runs every round plain."""

    def should_draft(self, batch_size: int) -> bool:
        return False


def make_engine(kind: str, target, drafter, concurrency: int) -> DSparkEngine:
    """The benchmark's engine for `kind`; `ha_plain` is the hardware-aware engine with a guard that never drafts."""
    options = dict(speculation_guard=NeverDraft()) if kind == "ha_plain" else {}
    return serving.make_engine(target, drafter, concurrency, SETTINGS[kind], SPSTable([1, 2048], [150.0, 140.0]),
                               **options)


def cell(engine: DSparkEngine, prompts, concurrency: int, args, profile: cProfile.Profile | None = None):
    """The benchmark's cell (`serving.drive`), optionally under `profile`; returns (seconds, the round log)."""
    with torch.inference_mode(), profile if profile is not None else contextlib.nullcontext():
        _, seconds = serving.drive(engine, prompts, concurrency, args)
    return seconds, engine.round_log


def median_round_ms(log: Iterable[dict]) -> float:
    return round(1e3 * statistics.median(entry["seconds"] for entry in itertools.islice(log, 2, None)), 2)


def host_phases(out: str, device: str) -> None:
    target, drafter, prompts = serving.load_models("code50m", torch.bfloat16, device)
    one_request = argparse.Namespace(max_new_tokens=64, requests_per_slot=1, length_spread=0.0)
    counter = torch.zeros(1, device=device)
    began = time.perf_counter()

    def python_loop() -> float:
        start = time.perf_counter()
        sum(range(300000))
        return round(1e3 * (time.perf_counter() - start), 2)

    def launches() -> float:
        synchronize(counter.device)
        start = time.perf_counter()
        for _ in range(2000):
            counter.add_(1)
        synchronize(counter.device)
        return round(1e3 * (time.perf_counter() - start), 2)

    def engine_cell(kind: str) -> float:
        return median_round_ms(cell(make_engine(kind, target, drafter, 1), prompts, 1, one_request)[1])

    report = dict(environment=environment(), threads_default=torch.get_num_threads(), cpu_count=os.cpu_count())
    engine_cell("nospec"), engine_cell("fixed7")  # warm-up

    def series(label: str) -> None:
        report[label] = []
        for _ in range(10):
            row = dict(t=round(time.perf_counter() - began, 2), py=python_loop(), launch=launches(),
                       nospec=engine_cell("nospec"), fixed7=engine_cell("fixed7"))
            report[label].append(row)
            print(label, row, flush=True)

    series("threads_default")
    torch.set_num_threads(1)
    series("threads_1")
    os.sched_setaffinity(0, {min(2, os.cpu_count() - 1)})
    series("affinity_core2")
    Path(out).write_text(json.dumps(report, indent=1) + "\n")


def plain_rounds(concurrency: int, device: str) -> None:
    target, drafter, prompts = serving.load_models("code50m", torch.bfloat16, device)
    args = CELL

    def run(kind: str, cell_args, profile: cProfile.Profile | None = None) -> None:
        seconds, log = cell(make_engine(kind, target, drafter, concurrency), prompts, concurrency, cell_args, profile)
        print(f"{kind} {concurrency} {seconds:.2f}s rounds {len(log)} median {median_round_ms(log)} ms "
              f"width {statistics.fmean(entry['width'] for entry in log):.0f}", flush=True)

    for kind in ("nospec", "ha_plain"):  # warm-up, as the benchmark's: 8 new tokens
        run(kind, serving.warm_up_args(args))
    for kind in ("nospec", "ha_plain") * 2:
        run(kind, args)
    for kind in ("nospec", "ha_plain"):
        profile = cProfile.Profile()
        run(kind, args, profile)
        for sort, restriction in (("tottime", 25), ("cumulative", ("dspark_hf", 30))):
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text).sort_stats(sort)
            stats.print_stats(*restriction) if isinstance(restriction, tuple) else stats.print_stats(restriction)
            print(text.getvalue())


def round_logs(out: str, concurrencies: list[int], device: str) -> None:
    target, drafter, prompts = serving.load_models("code50m", torch.bfloat16, device)
    with torch.inference_mode():
        sps_table = SPSTable.profile(target, model_name="code50m", progress=False, **serving.SPS_PROFILE)
    args, warm_up = CELL, serving.warm_up_args(CELL)
    settings = {name: setting for name, setting in serving.policies(0.5, drafter.config.num_draft_slots).items()
                if name in ("no_spec", "fixed_7", "hardware_aware")}
    settings["ha_plain"] = dict(settings["hardware_aware"], speculation_guard=NeverDraft())
    told: list[dict] = []
    record = serving.GUARD.record

    def logged_record(batch_size, seconds, verify_seconds, verify_tokens, tokens, catch_up=False):
        told.append(dict(batch=batch_size, seconds=seconds, verify_seconds=verify_seconds,
                         verify_tokens=verify_tokens, tokens=tokens, catch_up=catch_up))
        record(batch_size, seconds, verify_seconds, verify_tokens, tokens, catch_up)

    serving.GUARD.record = logged_record
    report = dict(environment=environment(), sps_table=sps_table.to_dict(), runs=[])
    with torch.inference_mode():
        for concurrency in concurrencies:
            for setting in settings.values():
                serving.run_cell(target, drafter, prompts, concurrency, setting, warm_up, sps_table)
            for repeat in range(2):
                told.clear()
                logs: dict[str, list] = {}
                cells, _ = serving.run_interleaved(target, drafter, prompts, concurrency, settings, args, sps_table,
                                                   round_logs=logs)
                report["runs"].append(dict(concurrency=concurrency, repeat=repeat, guard_records=list(told),
                                           guard=cells["hardware_aware"]["guard"],
                                           tokens_per_second={n: c["tokens_per_second"] for n, c in cells.items()},
                                           round_logs=logs))
                print(concurrency, repeat, {n: round(c["tokens_per_second"]) for n, c in cells.items()},
                      f"plain share {cells['hardware_aware']['plain_round_fraction']:.2f}", flush=True)
    Path(out).write_text(json.dumps(report) + "\n")


def round_log_report(path: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        report = json.load(handle)
    for run in report["runs"]:
        speeds, logs = run["tokens_per_second"], run["round_logs"]
        ratios = " ".join(f"{name}/no_spec {speed / speeds['no_spec']:.2f}" for name, speed in speeds.items()
                          if name != "no_spec")
        print(f"c = {run['concurrency']}, run {run['repeat']}: {ratios}")
        for name, log in logs.items():
            parts = []
            for kind, speculative in (("plain", False), ("speculative", True)):
                for admission in (False, True):
                    seconds = [entry["seconds"] for entry in log if entry["speculative"] == speculative
                               and bool(entry.get("admitted", 0)) == admission]
                    if seconds:
                        label = f"{kind}{' + admission' if admission else ''}"
                        parts.append(f"{label} {len(seconds)} x {1e3 * statistics.fmean(seconds):.1f} ms")
            known = "" if all("admitted" in entry for entry in log) else " (admissions not logged)"
            print(f"  {name:>15}: {sum(entry['seconds'] for entry in log):.2f} s = {', '.join(parts)}{known}")
        guard = (run.get("guard") or {}).get(str(run["concurrency"]))
        if guard:
            print(f"  {'guard':>15}: " + ", ".join(f"{key} {value:.2f}" if isinstance(value, float) else
                                                   f"{key} {value}" for key, value in guard.items()))


STATIC_SETTINGS = {  # name: (dtype, DSparkEngine options); static_compile None: compiled on CUDA
    "eager_engine_bf16": (torch.bfloat16, dict()),
    "eager_engine_fp32": (torch.float32, dict()),
    "static_bf16_eager_rounds": (torch.bfloat16, dict(static=True, static_compile=False)),
    "static_bf16_compiled": (torch.bfloat16, dict(static=True)),
    "static_fp32_eager_rounds": (torch.float32, dict(static=True, static_compile=False)),
    "static_fp32_compiled": (torch.float32, dict(static=True)),
    # the 2026-12-02 search for the GPU's lost drafts at c = 1 (results/serving_diagnostics/README.md)
    "static_bf16_compiled_no_cudagraphs": (torch.bfloat16, dict(static=True, static_compile=dict(mode="default",
                                                                                                 dynamic=False))),
    "static_bf16_compiled_one_slice": (torch.bfloat16, dict(static=True)),  # the attention kernel never splits
}


@torch.no_grad()
def reference_drafts(target, drafter, ids: list[int]) -> list[int]:
    """The drafts after `ids[-1]` from `drafter` given the target features of `ids[:-1]` at once, on a fresh cache."""
    device, length, block = target.device, len(ids) - 1, drafter.config.block_size
    tap = TargetLayerTap(target, drafter.config.target_layer_ids)
    with tap:
        target(input_ids=torch.tensor([ids[:-1]], device=device))
        features = tap.features()
    proposal = drafter.draft(torch.tensor([ids[-1]], device=device), features, DynamicCache(),
                             position_ids=torch.arange(length, length + block, device=device)[None],
                             context_position_ids=torch.arange(length, device=device)[None])
    return proposal.tokens[0].tolist()


def static_acceptance(out: str, concurrency: int, device: str, settings: list[str]) -> None:
    reference = serving.load_models("code50m", torch.float32, device)[:2]
    reference[1].share_target_weights(reference[0])
    results = {}
    for name in settings:
        dtype, options = STATIC_SETTINGS[name]
        with (mock.patch.object(static_attention, "_sm_count", lambda device: 1) if name.endswith("one_slice")
              else contextlib.nullcontext()):
            results[name] = acceptance_of(name, dtype, options, concurrency, reference)
    Path(out).write_text(json.dumps(dict(environment=environment(), concurrency=concurrency, cell=vars(CELL),
                                         policy="fixed, gamma 7", results=results), indent=2) + "\n")


def acceptance_of(name: str, dtype: torch.dtype, options: dict, concurrency: int, reference: tuple) -> dict:
    """τ, rounds and seconds of one static-acceptance setting; for the static engine, the share of its drafts
    equal to `reference`'s (float32 eager models) from the same committed context."""
    device = reference[0].device
    target, drafter, prompts = serving.load_models("code50m", dtype, device)
    longest = max(map(len, prompts)) + max(serving.request_lengths(concurrency * CELL.requests_per_slot, CELL))
    engine = DSparkEngine(target, drafter, policy="fixed", max_batch_size=concurrency, max_model_len=longest + 8,
                          **options)
    agreement = []
    if options.get("static"):
        engine.warm_up(progress=False)
        runner, step = engine.runner, engine.runner.step

        def checked_step(runner=runner, step=step):
            before = {slot: list(row.ids) for slot, row in enumerate(runner.owner) if row is not None}
            committed = step()
            for slot, ids in before.items():
                agreement.append(runner.rounds.drafts[slot].tolist() == reference_drafts(*reference, ids))
            return committed

        runner.step = checked_step
    seconds, log = cell(engine, prompts, concurrency, CELL)
    accepted = [n for entry in log for n in entry["accepted"]]
    result = dict(tau=(sum(accepted) + len(accepted)) / len(accepted), rounds=len(log), seconds=seconds,
                  drafts_equal_fp32_reference=statistics.fmean(agreement) if agreement else None)
    print(name, result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    phases = commands.add_parser("host-phases")
    phases.add_argument("out")
    plain = commands.add_parser("plain-rounds")
    plain.add_argument("--concurrency", type=int, default=256)
    logs = commands.add_parser("round-logs")
    logs.add_argument("out")
    logs.add_argument("--concurrency", type=int, nargs="+", default=[32, 256])
    commands.add_parser("round-log-report").add_argument("path")
    acceptance = commands.add_parser("static-acceptance")
    acceptance.add_argument("out")
    acceptance.add_argument("--concurrency", type=int, default=1)
    acceptance.add_argument("--settings", nargs="+", choices=list(STATIC_SETTINGS), default=list(STATIC_SETTINGS)[:6])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.command == "host-phases":
        host_phases(args.out, args.device)
    elif args.command == "round-logs":
        round_logs(args.out, args.concurrency, args.device)
    elif args.command == "static-acceptance":
        static_acceptance(args.out, args.concurrency, args.device, args.settings)
    elif args.command == "round-log-report":
        round_log_report(args.path)
    else:
        plain_rounds(args.concurrency, args.device)


if __name__ == "__main__":
    main()
