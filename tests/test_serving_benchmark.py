"""The serving benchmark's acceptance traces (benchmarks/serving.py): recording real rounds, replaying them on an
engine whose drafter accepts nothing, and the round breakdown with a replayed trace (tiny random models, CPU)."""

import argparse
import gzip
import itertools
import json
import operator
import random
import types
from collections import Counter
import sys
from pathlib import Path

import pytest
import torch
from conftest import shared_path

import dspark_hf
from dspark_hf.scheduling import RoundWidthChooser

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
serving = pytest.importorskip("serving")

ARGS = argparse.Namespace(max_new_tokens=16, requests_per_slot=2, length_spread=0.5)
FIXED = dict(policy="fixed", gamma=7)


@pytest.fixture(scope="module")
def models():
    return serving.tiny_models()


def trace_accepting(count: int, prompts, rows: int = 64) -> "serving.AcceptanceTrace":
    torch.manual_seed(0)
    return serving.AcceptanceTrace(torch.randn(rows, 7), torch.full((rows,), count), prompts)


@torch.inference_mode()
def test_recording_keeps_full_length_rounds(models):
    target, drafter, prompts = models
    recorded = []
    cell = serving.run_cell(target, drafter, prompts, 2, FIXED, ARGS, None, recorded=recorded)
    (trace,) = recorded
    assert trace.confidences.shape[1] == 7 and len(trace.accepted) == len(trace.confidences) > 0
    assert 0 <= int(trace.accepted.min()) and int(trace.accepted.max()) <= 7
    # one entry per request-round that verified all 7 drafts
    assert len(trace.accepted) == cell["verify_length_histogram"]["7"]


@pytest.mark.parametrize("accepted, low, high", [(0, 1.0, 1.0), (7, 4.0, 8.0)])
@torch.inference_mode()
def test_replay_sets_acceptance(models, accepted, low, high):
    target, drafter, prompts = models
    trace = trace_accepting(accepted, prompts)
    cell = serving.run_cell(target, drafter, prompts, 2, FIXED, ARGS, None, trace=trace)
    assert low <= cell["tau"] <= high
    lengths = serving.request_lengths(cell["requests"], ARGS)
    assert cell["generated_tokens"] == sum(lengths) and len(set(lengths)) > 1  # every request got its own length


@torch.inference_mode()
def test_round_breakdown_with_a_trace_covers_no_speculation(models):
    target, drafter, prompts = models
    trace = trace_accepting(3, prompts)
    for setting in (dict(policy="none"), FIXED):
        parts = serving.round_breakdown(target, drafter, prompts, 2, setting, ARGS, None, trace)["ms_per_round"]
        assert parts["verify_forward"] > 0 and (parts["draft_backbone"] > 0) == (setting["policy"] != "none")


@torch.inference_mode()
def test_interleaved_cells_compute_what_cells_run_alone_compute(models):
    """Stepping the policies' engines in turn changes only the clock: the same rounds, verify lengths and tokens."""
    target, drafter, prompts = models
    settings = {"no_spec": dict(policy="none"), "fixed_7": FIXED,
                "static_threshold": dict(policy="static_threshold", threshold=0.3)}
    logs = {}
    cells, recorded = serving.run_interleaved(target, drafter, prompts, 3, settings, ARGS, None, record="fixed_7",
                                              round_logs=logs)
    assert {name: len(log) for name, log in logs.items()} == {name: cell["rounds"] for name, cell in cells.items()}
    assert sum(entry["admitted"] for entry in logs["no_spec"]) == cells["no_spec"]["requests"]
    keys = ("requests", "generated_tokens", "rounds", "tau", "verify_length_histogram", "plain_round_fraction")
    for name, setting in settings.items():
        alone = serving.run_cell(target, drafter, prompts, 3, setting, ARGS, None)
        assert {k: cells[name][k] for k in keys} == {k: alone[k] for k in keys}
        assert 0 < cells[name]["seconds"] and cells[name]["tokens_per_second"] > 0
    assert cells["fixed_7"]["verify_length_histogram"] != cells["no_spec"]["verify_length_histogram"]
    assert len(recorded.accepted) == cells["fixed_7"]["verify_length_histogram"]["7"]  # only the recorded policy's


@torch.inference_mode()
def test_interleaved_cells_replay_a_trace_per_engine(models):
    target, drafter, prompts = models
    settings = {"no_spec": dict(policy="none"), "fixed_7": FIXED}
    cells, recorded = serving.run_interleaved(target, drafter, prompts, 2, settings, ARGS, None,
                                              trace=trace_accepting(7, prompts))
    assert recorded is None and cells["no_spec"]["tau"] == 1.0 and 4.0 <= cells["fixed_7"]["tau"] <= 8.0
    assert "draft" not in vars(drafter)  # every patch was taken off again


@torch.inference_mode()
@pytest.mark.parametrize("graph_sizes_per_cell, sequential, admission_rows, shared_graphs",
                         [(0, False, 1, False), (1, True, 2, False), (0, False, 1, True)])
def test_static_cells_run_every_policy_on_its_engine(models, graph_sizes_per_cell, sequential, admission_rows,
                                                     shared_graphs):
    """`--static`: each policy's runs (warm-up first) on its own engine kept for the concurrency, stepped in turn (or
    one after another; with `--shared-graphs` the drafting policies one after another on one engine); fixed γ
    verifies γ drafts per round, no speculation none, the hardware-aware chooser any of its widths, and every request
    gets its length. `--graph-sizes-per-cell 1`: every round runs all the concurrency's rows; `--admission-rows 2`:
    requests joining together share their admission chunks. The compact round logs hold every run's rounds, warm-up
    run first."""
    target, drafter, prompts = models
    args = argparse.Namespace(**vars(ARGS), repeats=2, dynamic_batch=False, admission_batch=1,  # (CPU: no compile)
                              graph_sizes_per_cell=graph_sizes_per_cell, sequential=sequential,
                              admission_rows=admission_rows, eager_admission_from=None, shared_graphs=shared_graphs)
    names = ["no_spec", "fixed_1", "fixed_3", "fixed_7", "hardware_aware"]
    logs = {}
    runs = serving.run_static_cells(target, drafter, prompts, 2, names, args, logs)
    lengths = serving.request_lengths(4, ARGS)
    assert set(logs) == set(names) and all(len(log) == 3 for log in logs.values())  # the warm-up run + 2
    for name in names:
        ended, rows, admitted, verify, accepted, admit_ms, step_ms, upkeep, deliver_ms, choice, rates, outside_ms = zip(
            *logs[name][-1])
        assert len(ended) == runs[name][-1]["rounds"] and list(ended) == sorted(ended) and min(step_ms) > 0
        kinds = {None, "flush", "catch_up"} if name == "hardware_aware" else {None}  # (fixed widths never flush)
        assert min(deliver_ms) > 0 and set(upkeep) <= kinds and min(outside_ms) > 0
        if name == "hardware_aware":  # (why the chooser chose each round's width, and the rates it compared)
            reasons = [entry[9] for run in logs[name] for entry in run]  # (it measured each width in the warm-up run)
            assert "measure" in reasons
            assert set(reasons) <= {"settled", "measure", "confirm", "switch", "keep", "refresh", "state"}
            compared = [entry for entry in rates if entry is not None]
            assert compared and all(set(entry) == {"0", "1", "3", "7"} for entry in compared)
        else:
            assert set(choice) == {None} and set(rates) == {None}
        assert sum(admitted) == 4 and sum(accepted) + sum(rows) == runs[name][-1]["generated_tokens"] - 4
        assert set(verify) == {int(k) for k in runs[name][-1]["verify_length_histogram"]}
    for name in names:
        assert len(runs[name]) == 2
        for cell in runs[name]:
            assert cell["generated_tokens"] == sum(lengths) and cell["tokens_per_second"] > 0
            assert cell["warm_up_seconds"] > 0  # every graph ran before the runs
            assert cell["gc_ms"] >= 0 and cell["gc_full"] >= 0
            assert cell["compiled_graphs"] == 0  # (nothing compiles on the CPU; on CUDA, warm_up() compiled them all)
            split = cell["admit_ms_per_round"] + cell["step_ms_per_round"] + cell["other_ms_per_round"]
            assert split == pytest.approx(cell["round_ms"]) and cell["step_ms_per_round"] > 0
            assert cell["admit_ms_per_round"] > 0 and cell["other_ms_per_round"] > 0  # (delivering: outside both)
            assert ("chooser" in cell) == (name == "hardware_aware")
            widths = {int(k) for k in cell["verify_length_histogram"]}
            expected = {"no_spec": {0}, "hardware_aware": {0, 1, 3, 7}}.get(name) or {int(name.split("_")[1])}
            assert widths <= expected and widths
    chooser = runs["hardware_aware"][-1]["chooser"]  # per number of rows the rounds ran, per width
    assert "2" in chooser and all(set(widths) == {"0", "1", "3", "7"} for widths in chooser.values())
    assert set(chooser) - {"2/1"} == ({"2"} if graph_sizes_per_cell == 1 else {"1", "2"})  # ("2/1": 1 request)
    assert all(cell["matched_no_spec"] == 1.0 for name in names[1:] for cell in runs[name])  # float32: lossless
    warm_up = {name: runs[name][0]["warm_up_seconds"] for name in names}  # (one value per engine)
    assert (len(set(warm_up.values())) == 2) == shared_graphs and len(set(warm_up.values())) in (2, 5)


@torch.inference_mode()
@pytest.mark.parametrize("shared_graphs", [False, True])
def test_static_cells_replay_a_trace_on_the_speculative_engines(models, shared_graphs):
    """`--static` with a trace (the Qwen3-4B shape's random weights): every drafting round of fixed γ accepts the
    trace's count capped at γ, no speculation is untouched, and the hardware-aware chooser learns the replayed
    acceptance (a trace of 7 accepted drafts: nearly all its drafts survive)."""
    target, drafter, prompts = models
    args = argparse.Namespace(**vars(ARGS), repeats=1, dynamic_batch=False, admission_batch=1, graph_sizes_per_cell=1,
                              sequential=False, admission_rows=1, eager_admission_from=None,
                              shared_graphs=shared_graphs)
    names = ["no_spec", "fixed_3", "fixed_7", "hardware_aware"]
    logs = {}
    runs = serving.run_static_cells(target, drafter, prompts, 2, names, args, logs, trace=trace_accepting(7, prompts))
    for name, width in (("fixed_3", 3), ("fixed_7", 7)):
        (cell,) = runs[name]
        assert cell["generated_tokens"] == sum(serving.request_lengths(4, ARGS)) and "matched_no_spec" not in cell
        drafting = [entry for entry in logs[name][-1] if entry[3] == width]
        # every row of a round accepts all its drafts, except where a request's budget ends first
        assert sum(entry[4] == width * entry[1] for entry in drafting) > 0.5 * len(drafting)
    assert runs["no_spec"][0]["tau"] == 1.0 and runs["fixed_7"][0]["tau"] > 4.0
    chooser = runs["hardware_aware"][0]["chooser"]["2"]
    tokens_per_row = {width: entry["tokens_per_row"] for width, entry in chooser.items()}
    # (each hazard is the posterior mean (accepted + 1) / (reached + 2) of a few dozen rows, so not quite 1; a trace
    # that accepted nothing would give about 1)
    assert tokens_per_row["7"] > 5.5 and tokens_per_row["3"] > 3.5


@torch.inference_mode()
def test_static_cells_replay_the_same_acceptance_to_every_policy_of_a_run(models):
    """With a trace of 0-3 accepted drafts, fixed γ = 3 and γ = 7 accept alike when both draw the same entries in the
    same round: their runs are then identical round by round. `--shared-graphs` puts both on one engine and one
    replayer, which each run restarts with that run's seed (with one stream the second policy drew other entries);
    the two repeats draw differently from each other."""
    target, drafter, prompts = models
    args = argparse.Namespace(**vars(ARGS), repeats=2, dynamic_batch=False, admission_batch=1, graph_sizes_per_cell=1,
                              sequential=False, admission_rows=1, eager_admission_from=None, shared_graphs=True)
    torch.manual_seed(0)
    trace = serving.AcceptanceTrace(torch.randn(64, 7), torch.randint(0, 4, (64,)), prompts)
    logs = {}
    serving.run_static_cells(target, drafter, prompts, 2, ["fixed_3", "fixed_7"], args, logs, trace=trace)

    def rounds(log):  # (rows, admitted, accepted) per round
        return [(entry[1], entry[2], entry[4]) for entry in log]

    for run in (1, 2):
        assert rounds(logs["fixed_3"][run]) == rounds(logs["fixed_7"][run])
    assert rounds(logs["fixed_7"][1]) != rounds(logs["fixed_7"][2])


def test_plain_round_tax_splits_each_round_around_its_device_work(models):
    """benchmarks/plain_round_tax.py: a round's wall-clock time splits into host time before its first kernel, the
    union of its (overlapping) kernels, the idle gaps between them and the time after the last; medians over rounds.
    On the CPU a profiled engine has no device work: all of a round is before it."""
    import plain_round_tax

    timeline = plain_round_tax.round_timeline([(0, 100)], [(10, 30), (25, 50), (60, 70), (150, 160)])
    assert timeline == pytest.approx(dict(wall=0.1, before_device=0.01, device_busy=0.05, device_gaps=0.01,
                                          after_device=0.03))
    idle = plain_round_tax.round_timeline([(0, 100), (100, 400), (400, 600)], [(110, 120), (420, 440)])
    assert (idle["wall"], idle["device_busy"], idle["before_device"]) == pytest.approx((0.2, 0.01, 0.02))
    target, drafter, prompts = models
    engine = plain_round_tax.build("plain_with_context", target, drafter, 2, 64)
    for prompt in prompts[:2]:
        engine.add_request(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.step()
    kernels, timeline = plain_round_tax.profile_rounds(engine, 3)
    assert kernels == {} and timeline["wall"] > 0 and timeline["before_device"] == timeline["wall"]


def test_serving_main_marks_the_target_layers_and_writes_where_it_is_told(tmp_path, monkeypatch):
    """`serving.py --compile-layers-once --admission-batch auto` (smoke models, no --out): the target's layers become
    one compile region and the JSON goes to the smoke run's temporary directory with the settings recorded; nothing
    goes to the results directory (the flag once sat where it swallowed the real models' output path and trace)."""
    models = serving.tiny_models()
    monkeypatch.setattr(serving, "tiny_models", lambda: models)
    (smoke := tmp_path / "smoke").mkdir()
    (results := tmp_path / "results").mkdir()
    monkeypatch.setattr(serving.tempfile, "mkdtemp", lambda prefix: str(smoke))
    monkeypatch.setattr(serving, "RESULTS", results)
    monkeypatch.setattr(sys, "argv", ["serving.py", "--model", "smoke", "--static", "--compile-layers-once",
                                      "--concurrency", "2", "--repeats", "1", "--min-requests", "0", "--no-paged",
                                      "--policies", "no_spec", "fixed_3", "--admission-batch", "auto"])
    serving.main()
    assert getattr(type(models[0].model.layers[0]), "_compiled_once", False)
    settings = json.loads((smoke / "serving_smoke.json").read_text())["models"]["smoke"]["settings"]
    assert settings["compile_layers_once"] is True and settings["concurrency"] == [2]
    assert "admission_batch auto" in settings["engine"]
    assert list(results.iterdir()) == []


def test_compile_breakdown_reads_torchs_compile_phases():
    """benchmarks/compile_breakdown.py: after a compilation, torch's compile-time table as seconds per phase, largest
    first, with dynamo's outermost phase among them."""
    import compile_breakdown

    torch._dynamo.reset()
    torch.compile(lambda x: (x * 2).sin(), backend="aot_eager")(torch.ones(3))
    phases = compile_breakdown.phase_seconds()
    assert "_compile.compile_inner" in phases and all(seconds >= 0 for seconds in phases.values())
    assert list(phases.values()) == sorted(phases.values(), reverse=True)


def test_engine_host_benchmark_times_stubbed_rounds_that_commit_tokens():
    """benchmarks/engine_host_cpu.py: the stubbed rounds go through the engine's whole host path (every request
    receives tokens) and a time per round comes back."""
    engine_host = pytest.importorskip("engine_host_cpu")
    delivered = []
    milliseconds = engine_host.host_ms_per_round(rows=4, rounds=3, repeats=2, on_engine=delivered.append)
    assert milliseconds > 0
    (engine,) = delivered
    assert engine.requests and all(len(request.tokens) > 6 for request in engine.requests.values())  # 1 + 6 rounds


def test_engine_host_benchmark_reports_the_collectors_pauses_while_serving():
    """benchmarks/engine_host_cpu.py --gc: stubbed engines serve every request in full, and the collector's pauses,
    the objects it still tracks and one full collection's time come back."""
    engine_host = pytest.importorskip("engine_host_cpu")
    result = engine_host.collector_pauses(rows=4, engines=2, runs=2, prompt_tokens=6, new_tokens=10)
    assert result["rounds"] >= 2 * 2 * 4  # per engine and run: 16 requests of 10 tokens, 4 rows at a time
    assert result["pause_ms"] == pytest.approx(sum(entry["ms"] for entry in result["pauses"].values()), abs=0.05)
    assert result["tracked_after"] > 0 and result["full_collection_ms"] >= 0


def test_paired_summary_divides_each_repeat_by_the_same_repeat_of_the_others():
    """Repeat k of hardware-aware over the best static policy's repeat k and over no speculation's; the summary is
    the smallest median over concurrencies. A concurrency whose policies ran different numbers of repeats is left
    out."""
    def cells(runs_by_level):
        return [dict(concurrency=level, tokens_per_second_runs=runs) for level, runs in runs_by_level.items()]

    models = {"m": dict(results={
        "no_spec": cells({1: [50.0, 50.0, 50.0], 8: [100.0, 100.0]}),
        "fixed_3": cells({1: [90.0, 120.0, 100.0], 8: [100.0, 100.0]}),
        "fixed_7": cells({1: [100.0, 100.0, 110.0], 8: [100.0, 100.0]}),
        "hardware_aware": cells({1: [95.0, 120.0, 121.0], 8: [90.0, 100.0, 110.0]}),
    })}
    summary = serving.paired_summary(models)
    ratios = summary["paired_ratios_by_model"]["m"]
    assert ratios["scheduler_vs_best_static"] == {"1": pytest.approx([0.95, 1.0, 1.1])}  # 8: 3 repeats against 2
    assert ratios["scheduler_vs_nospec"] == {"1": pytest.approx([1.9, 2.4, 2.42])}
    assert summary["paired_scheduler_vs_best_static_min_median"] == pytest.approx(1.0)
    assert summary["paired_scheduler_vs_nospec_min_median"] == pytest.approx(2.4)


def test_engine_host_benchmark_times_the_width_chooser():
    engine_host = pytest.importorskip("engine_host_cpu")
    during, between = engine_host.chooser_us_per_round(rows=4, rounds=200, repeats=1)
    assert during > 0 and between > 0


def test_chooser_replay_runs_the_chooser_on_measured_round_times():
    """benchmarks/chooser_replay.py on the committed H200 round logs: the fitted hazards reproduce the measured tokens
    per row, the fixed widths' replayed rates order as the GPU measured them (fixed γ = 7 first at c = 64), and the
    chooser's rate and rounds come back."""
    replay = pytest.importorskip("chooser_replay")
    path = serving.RESULTS / "serving_static_round_logs_h200.json.gz"
    logs = json.load(gzip.open(path, "rt"))
    cells = json.loads(path.with_suffix("").read_text())["models"]["code50m"]["results"]["hardware_aware"]
    measured = next(cell for cell in cells if cell["concurrency"] == 64)["chooser"]["64"]
    tokens_per_row = {int(width): entry["tokens_per_row"] for width, entry in measured.items()}
    survival = list(itertools.accumulate(replay.fitted_hazards(tokens_per_row), operator.mul))
    for width in (1, 3, 7):
        assert 1 + sum(survival[:width]) == pytest.approx(tokens_per_row[width], abs=1e-6)
    report = replay.replay_concurrency(logs["runs"]["64"], tokens_per_row, 64)
    rates = report["tokens_per_second"]
    assert report["best_fixed"] == 7 and rates["fixed_7"] > rates["fixed_3"] > rates["fixed_0"]
    assert 0.9 < report["chooser_over_best_fixed"] < 1.1 and sum(report["chooser_rounds"].values()) > 500


def test_engines_stepped_in_turn_meet_every_neighbour_alike():
    """`step_in_turn` runs one round of each unfinished engine per sweep, in a new order each sweep: over many sweeps
    each engine follows each other one about equally often (in a rotated order fixed γ = 7 followed no speculation
    in a quarter of its rounds and hardware-aware almost never)."""
    steps = []

    class Stub:
        target = types.SimpleNamespace(device=torch.device("cpu"))

        def __init__(self, name, rounds):
            self.name, self.left = name, rounds

        def has_unfinished(self):
            return self.left > 0

        def step(self):
            self.left -= 1
            steps.append(self.name)

    names = ["no_spec", "fixed_3", "fixed_7", "hardware_aware"]
    seconds, _ = serving.step_in_turn({name: Stub(name, 600) for name in names}, seed=3)
    assert len(steps) == 2400 and set(seconds) == set(names)
    assert all(steps[4 * k: 4 * k + 4].count(name) == 1 for k in range(600) for name in names)  # once per sweep
    follows = Counter(zip(steps, steps[1:]))
    for before in names:
        for after in names:
            if before != after:
                assert 150 < follows[before, after] < 250, (before, after, follows[before, after])  # about 1/4 of 600


@pytest.mark.fixtures
@pytest.mark.slow
def test_round_width_overhead_times_every_engine_on_the_code_fixture(tmp_path, monkeypatch):
    """benchmarks/round_width_overhead.py on the CPU (the 50M fixture in float32, which this CPU runs several times
    faster than bfloat16; 2 rows, 8 tokens), its plain rounds (`--width 0`): the engine without speculation (the
    reference), one with caches as long as a speculative engine's, the hardware-aware one pinned to plain rounds
    without `record`, and the hardware-aware one, whose chooser's calls are timed."""
    shared_path("fixtures", "code-llama-50m")
    shared_path("data", "humaneval", "HumanEval.jsonl.gz")
    overhead = pytest.importorskip("round_width_overhead")
    out = tmp_path / "overhead.json"
    engines = ["fixed_0", "fixed_0_wide", "hardware_aware_pinned_0_no_record", "hardware_aware"]
    monkeypatch.setattr(sys, "argv", ["round_width_overhead.py", "--device", "cpu", "--dtype", "float32",
                                      "--concurrency", "2", "--new-tokens", "8", "--repeats", "1", "--width", "0",
                                      "--engines", *engines, "--profile-rounds", "2", "--out", str(out)])
    overhead.main()
    cell = json.loads(out.read_text())["cells"]["2"]
    times = cell["median_step_ms_runs"]
    assert list(times) == engines
    assert all(times[name][0] > 0 for name in engines[:3])  # (hardware-aware may run no plain round)
    assert cell["ratio_to_fixed_0_runs"]["fixed_0"] == [1.0]
    assert cell["chooser_call_us"]["choose"] > 0 and cell["chooser_call_us"]["record"] > 0
    columns = cell["cache_columns"]  # (the wide engine's caches as long as the speculative engines')
    assert columns["fixed_0"] < columns["fixed_0_wide"] == columns["hardware_aware"] == columns[engines[2]]
    profiled = cell["kernel_times"]  # (on the CPU the operators' own time)
    assert list(profiled) == engines
    assert all(entry["device_us_per_round"] > 0 and entry["kernels_per_round"] > 0 for entry in profiled.values())
    assert all(calls > 0 and us > 0 for entry in profiled.values() for calls, us in entry["kernels"].values())


def test_round_widths_times_every_width_of_the_engines_rows():
    """`benchmarks/round_widths.py` on tiny models: a median time per width, each over the plain round's."""
    import round_widths

    target, drafter, prompts = serving.tiny_models()
    args = argparse.Namespace(prompt_tokens=12, rounds=2, repeats=1, compile=False, device="cpu")
    cell = round_widths.round_ms(target, drafter, prompts, 3, args)
    assert set(cell) == {"0", "1", "3", "7"} and cell["0"]["over_plain"] == 1.0
    for entry in cell.values():
        assert entry["round_ms"] > 0 and entry["over_plain"] == pytest.approx(entry["round_ms"] / cell["0"]["round_ms"],
                                                                              rel=1e-3)


def test_chooser_on_text_times_each_round_by_its_width_and_tells_the_chooser_so():
    """`benchmarks/chooser_on_text.py` on tiny models: each round costs its width's given time (no noise here), the
    run's GPU seconds add them up, and the hardware-aware chooser is told those times, not the CPU's."""
    import chooser_on_text

    target, drafter, prompts = serving.tiny_models()
    times = {0: 1e-3, 1: 2e-3, 3: 3e-3, 7: 4e-3}
    args = argparse.Namespace(max_new_tokens=24, length_spread=0.5, requests_per_slot=4, min_requests=8)
    for policy in ("fixed_3", "hardware_aware"):
        engine = chooser_on_text.make(target, drafter, policy, 2, max(map(len, prompts)) + 40)
        clock = chooser_on_text.GpuClock(engine, times, spread=0.0, seed=0)
        result = chooser_on_text.serve(engine, clock, prompts, 2, args)
        assert result["gpu_seconds"] == pytest.approx(sum(times[w] * n for w, n in result["rounds"].items()))
        assert result["tokens"] == sum(serving.request_lengths(8, args))
        if policy == "fixed_3":
            assert set(result["rounds"]) == {3} and "log" not in result
        else:
            assert len(result["log"]) == sum(result["rounds"].values())
            measured = {width: entry["round_ms"] for width, entry in engine.runner.chooser.summary()[2, 2].items()
                        if entry["round_ms"] is not None}
            assert measured and all(ms == pytest.approx(1e3 * times[width]) for width, ms in measured.items())


def test_chooser_on_text_estimates_a_narrower_width_from_wider_rounds():
    """`tokens_per_round`: from rows' accepted drafts in rounds of width 7, a width's tokens per round as measured
    (the mean of min(k, v) + 1) and by renewal (each observation standing for the min(k, 7) + 1 positions its round
    committed: the harmonic mean of min(k, v) + 1 over positions), which for the widest width is the mean itself."""
    from chooser_on_text import tokens_per_round

    accepted = [0, 3, 7, 7]
    assert tokens_per_round(accepted, 3, renewal=False) == pytest.approx(1 + (0 + 3 + 3 + 3) / 4)
    assert tokens_per_round(accepted, 3, renewal=True) == pytest.approx((1 + 4 + 8 + 8) / (1 + 1 + 2 + 2))
    assert tokens_per_round(accepted, 7, renewal=True) == pytest.approx(tokens_per_round(accepted, 7, renewal=False))


def test_chooser_on_text_counts_the_drafts_accepted_after_each_acceptance_state():
    """`next_round_by_state`: each drafting round of a request counts under the state its last round left it in
    (AFTER_PLAIN for its first round and after a plain round; FULL + width after a round that accepted every draft)."""
    from chooser_on_text import next_round_by_state

    from dspark_hf.scheduling.round_widths import AFTER_PLAIN, FULL

    requests = [([7, 7, 7, 0, 3], [7, 2, 0, 0, 3]), ([3, 3], [3, 1])]
    assert next_round_by_state(requests) == {
        AFTER_PLAIN: dict(rounds=3, accepted=(7 + 3 + 3) / 3),  # (first rounds, and the round after the plain one)
        2: dict(rounds=1, accepted=0.0),
        FULL + 3: dict(rounds=1, accepted=1.0),
        FULL + 7: dict(rounds=1, accepted=2.0),
    }


def test_acceptance_field_predicts_the_static_engines_rounds_on_the_code_fixture():
    """benchmarks/acceptance_field.py on the 50M fixture and its drafter (2 requests, 20 tokens): a fixed-width static
    engine's accepted drafts, round by round, are the field's at each round's anchor (min(field, width); the round log
    cuts a request's last round at its end, the field matches past it as the engine's verification does)."""
    shared_path("fixtures", "code-llama-50m")
    shared_path("data", "humaneval", "HumanEval.jsonl.gz")
    import acceptance_field
    from common import REPO, humaneval_prompts, load_target
    from transformers import AutoTokenizer

    from dspark_hf.serving import DSparkEngine

    target = load_target("code50m", torch.float32, "cpu").eval()
    drafter = dspark_hf.DSparkDraftModel.from_pretrained(REPO / "drafters" / "code50m-dspark",
                                                         dtype=torch.float32).eval()
    drafter.share_target_weights(target)
    tokenizer = AutoTokenizer.from_pretrained(target.config._name_or_path)
    prompts = [tokenizer(text)["input_ids"] for text in humaneval_prompts(2)]
    fields = [acceptance_field.request_field(target, drafter, prompt, 20) for prompt in prompts]
    assert any(0 < count < 7 for field in fields for count in field) and max(map(max, fields)) == 7
    for width in (3, 7):
        engine = DSparkEngine(target, drafter, static=True, policy="fixed", gamma=width, max_batch_size=1,
                              max_model_len=max(map(len, prompts)) + 40, static_graph_batch_sizes={1})
        for prompt, field in zip(prompts, fields):
            engine.add_request(prompt, max_tokens=20, temperature=0.0, ignore_eos=True)
            while engine.has_unfinished():
                engine.step()
            recorded = [count for entry in engine.round_log for count in entry["accepted"]]
            engine.round_log.clear()
            anchor, predicted = 0, []
            while anchor < 19:  # (the prefill commits token 0; a round anchored at i commits up to i + accepted + 1)
                accepted = min(field[anchor], width)
                predicted.append(min(accepted, 18 - anchor))
                anchor += accepted + 1
            assert recorded == predicted


def test_chooser_on_field_serves_fixed_widths_exactly_and_runs_the_chooser_as_the_engine_does():
    """benchmarks/chooser_on_field.py on a made-up field: a fixed width commits min(field, width) + 1 tokens a round
    from each row's anchor (requests joining at once, lowest free row first, each cut at its length), every round
    costs its width's time, and the chooser's rounds add up to the same tokens. With `admission`, each request's
    admission costs its kind's seconds (plain decoding's without the drafter's context), and the chooser is told each
    admission and each request that leaves with its tokens."""
    import chooser_on_field

    field = [[7, 0, 3, 1, 7, 7, 2, 0] * 4, [0] * 32]
    rows = chooser_on_field.FieldRows(field, 2)
    waiting = [(0, 10), (1, 3), (1, 2)]
    rows.admit(waiting)
    assert rows.requests == [(0, 9), (1, 2)] and waiting == [(1, 2)]
    assert rows.round(3) == [3, 0]  # row 0: anchor 0 -> 4; row 1: anchor 0 -> 1
    assert rows.position == [4, 1] and rows.requests == [(0, 5), (1, 1)]
    assert rows.round(7) == [7, 0]  # row 0 commits 5 (its last), row 1 its last one: both leave
    assert rows.occupied() == []
    rows.admit(waiting)
    assert rows.requests[0] == (1, 1) and rows.position[0] == 0
    times = {0: 1e-3, 1: 2e-3, 3: 3e-3, 7: 4e-3}
    lengths = [12, 20, 7, 16]
    clock = chooser_on_field.noisy_times(times, 0.0, random.Random(0))
    fixed = chooser_on_field.serve(field, lengths, chooser_on_field.FieldRows(field, 2), 3, None, clock)
    assert fixed["tokens"] == sum(lengths)
    assert fixed["gpu_seconds"] == pytest.approx(3e-3 * fixed["rounds"][3]) and set(fixed["rounds"]) == {3}
    chooser = RoundWidthChooser((0, 1, 3, 7))
    chosen = chooser_on_field.serve(field, lengths * 8, chooser_on_field.FieldRows(field, 2), None, chooser, clock)
    assert chosen["tokens"] == 8 * sum(lengths) and set(chosen["rounds"]) == {0, 1, 3, 7}
    assert chosen["gpu_seconds"] == pytest.approx(sum(times[w] * n for w, n in chosen["rounds"].items()))
    assert chooser.summary()[2, 2][7]["round_ms"] == pytest.approx(4.0)
    switching = chooser_on_field.serve(field, lengths, chooser_on_field.FieldRows(field, 2), None,
                                       RoundWidthChooser((0, 1, 3, 7)), clock, switch_cost=0.5)
    changes = switching["gpu_seconds"] - sum(times[w] * n for w, n in switching["rounds"].items())
    assert changes > 0 and changes / 1e-3 == pytest.approx(round(changes / 1e-3 * 2) / 2)  # (halves of 1-4 ms)
    for overhead, told_ms in (("told", 0.5), ("none", 0.0)):  # (the step around each round: 0.5 ms, every policy's)
        chooser = RoundWidthChooser((0, 1, 3, 7))
        around = chooser_on_field.serve(field, lengths * 4, chooser_on_field.FieldRows(field, 2), None, chooser,
                                        clock, step_overhead=lambda width, _: 5e-4, overhead=overhead)
        assert around["gpu_seconds"] == pytest.approx(sum((times[w] + 5e-4) * n for w, n in around["rounds"].items()))
        assert chooser.summary()[2, 2][7]["overhead_ms"] == pytest.approx(told_ms)
    for width, each in ((3, 2e-3), (0, 1e-3)):  # admissions: with the drafter's context 2 ms a request, without 1 ms
        admitted = chooser_on_field.serve(field, lengths, chooser_on_field.FieldRows(field, 2), width, None, clock,
                                          admission=(2e-3, 1e-3))
        assert admitted["gpu_seconds"] == pytest.approx(times[width] * admitted["rounds"][width] + each * len(lengths))

    class Told(RoundWidthChooser):
        def record_admission(self, seconds, requests, prompt_context=True):
            admissions.append((seconds, requests, prompt_context))

        def record_finished(self, tokens, requests=1):
            finished.append((tokens, requests))

    admissions, finished = [], []
    chosen = chooser_on_field.serve(field, lengths * 4, chooser_on_field.FieldRows(field, 2), None,
                                    Told((0, 1, 3, 7)), clock, admission=(2e-3, 1e-3))
    assert sum(requests for _, requests, _ in admissions) == sum(requests for _, requests in finished) == 16
    assert sum(tokens for tokens, _ in finished) == 4 * sum(lengths)
    assert chosen["gpu_seconds"] == pytest.approx(sum(times[w] * n for w, n in chosen["rounds"].items())
                                                  + sum(seconds for seconds, _, _ in admissions))
    assert all(seconds == pytest.approx(requests * (2e-3 if context else 1e-3))
               for seconds, requests, context in admissions)


def test_chooser_on_field_charges_a_catch_up_after_bare_plain_rounds_and_tells_the_chooser_the_round_without_it():
    """`serve(catch_up=...)`: after `PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER` plain rounds in a row the plain rounds
    are bare, and the next drafting round pays the catch-up first, once; the chooser gets that round's time without
    it (with `told_catch_up`, with it). A fixed drafting width never pays one."""
    import chooser_on_field

    from dspark_hf.generation.static_rows import PLAIN_ROUNDS_BEFORE_PROMPTS_SKIP_DRAFTER as LONG

    class Scripted(RoundWidthChooser):  # plain rounds, then rounds of 3 drafts; notes what `record` is told
        def __init__(self):
            super().__init__((0, 3), state_rows=0)
            self.script, self.recorded = iter([0] * (LONG + 8)), []

        def choose(self, rows=0, requests=None):
            self.reason = "settled"
            return next(self.script, 3)

        def record(self, width, seconds, *args, **kwargs):
            self.recorded.append((width, seconds))

    field, times = [[0] * 80] * 2, {0: 1e-3, 3: 3e-3}
    clock = chooser_on_field.noisy_times(times, 0.0, random.Random(0))
    for told in (False, True):
        chooser = Scripted()
        served = chooser_on_field.serve(field, [60, 60], chooser_on_field.FieldRows(field, 2), None, chooser, clock,
                                        catch_up=5e-3, told_catch_up=told)
        assert served["rounds"] == {0: LONG + 8, 3: 59 - LONG - 8}
        assert served["gpu_seconds"] == pytest.approx(sum(times[w] * n for w, n in served["rounds"].items()) + 5e-3)
        drafting = [seconds for width, seconds in chooser.recorded if width == 3]
        assert len(drafting) == 59 - LONG - 8 and drafting[0] == pytest.approx(8e-3 if told else 3e-3)
        assert drafting[1:] == pytest.approx([3e-3] * (len(drafting) - 1))
    fixed = chooser_on_field.serve(field, [60, 60], chooser_on_field.FieldRows(field, 2), 3, None, clock,
                                   catch_up=5e-3)
    assert fixed["gpu_seconds"] == pytest.approx(3e-3 * 59)


def test_row_freeing_times_the_upkeep_and_leaves_the_rows_free():
    """`benchmarks/row_freeing.py` on the CPU: per number of freed rows, greedy and sampled, the host time of `remove`
    and of an admission's sampling settings (the spread of its trials)."""
    row_freeing = pytest.importorskip("row_freeing")
    results = row_freeing.time_upkeep(torch.device("cpu"), rows=4, freed=[1, 3], trials=3)
    assert [(result["freed"], result["sampled"]) for result in results] == [(1, False), (1, True), (3, False),
                                                                            (3, True)]
    for result in results:
        for part in ("remove", "remove_and_its_device_work", "set_sampling"):
            spread = result[part]
            assert 0 < spread["p10_us"] <= spread["median_us"] <= spread["p90_us"]
    assert row_freeing.sync_probe(torch.device("cpu"), 2) is None  # (CUDA only)
