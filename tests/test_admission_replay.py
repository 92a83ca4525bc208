"""benchmarks/admission_replay.py: a measured cell's plain decoding modelled under other admission settings."""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_target

from dspark_hf.serving import DSparkEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import admission_replay  # noqa: E402


@pytest.mark.parametrize("admission_batch", [1, 2, 3])
def test_the_model_joins_as_the_engine_does(admission_batch):
    """Requests of known lengths, queued at once, on the plain engine (4 rows): the model's joins (how many requests
    each) are the engine's own, whatever the costs."""
    target = tiny_target()
    lengths = [3, 9, 1, 5, 12, 4, 4, 7, 2, 10, 6, 3]
    engine = DSparkEngine(target, None, max_batch_size=4, admission_batch=admission_batch, policy="none")
    for index, length in enumerate(lengths):
        engine.add_request([5 + index, 6, 7], max_tokens=length, temperature=0.0, ignore_eos=True)
    engine.run()
    joins = [entry["admitted"] for entry in engine.round_log if entry["admitted"]]
    seconds, modelled = admission_replay.modelled_cell(lengths, 4, rows_per_set=2, set_seconds=0.04,
                                                       first_seconds=0.1, round_seconds=0.01,
                                                       admission_batch=admission_batch)
    assert modelled == joins and sum(joins) == len(lengths)
    rounds = len(engine.round_log)
    sets = sum(math.ceil(size / 2) for size in joins[1:])
    assert seconds == pytest.approx(0.1 + 0.04 * sets + 0.01 * rounds)


def test_auto_holds_where_joins_are_dear_and_not_where_rows_free_rarely():
    """The model with `JoinGate`: at 32 rows, joins of 40 ms and rounds of 6 ms (the Qwen3-4B shape on the H200), auto
    joins fewer times and serves more than joining at once; at 2 rows it does as joining at once does."""
    lengths = [32 + (17 * index) % 65 for index in range(128)]
    at_once = admission_replay.modelled_cell(lengths, 32, 16, 0.04, 0.1, 0.006, 1)
    auto = admission_replay.modelled_cell(lengths, 32, 16, 0.04, 0.1, 0.006, "auto")
    assert len(auto[1]) < len(at_once[1]) / 3 and auto[0] < 0.7 * at_once[0]
    lengths = lengths[:16]
    assert admission_replay.modelled_cell(lengths, 2, 16, 0.014, 0.014, 0.0047, "auto") == \
        admission_replay.modelled_cell(lengths, 2, 16, 0.014, 0.014, 0.0047, 1)


def test_main_reads_a_cell_and_reports_each_setting(tmp_path, monkeypatch, capsys):
    """A synthetic one-cell call (two timed runs of 4 requests at c = 2): per-set, first-prefill and round times
    come out of the no-speculation runs' logs; every setting is modelled; the measured times are the runs' own."""
    columns = ["ended_ms", "rows", "admitted", "verify", "accepted", "admit_ms", "step_ms"]
    run = [[0, 2, 2, 0, 0, 30.0, 5.0], [0, 2, 0, 0, 0, 0.0, 5.0], [0, 2, 1, 0, 0, 12.0, 5.0],
           [0, 2, 1, 0, 0, 16.0, 6.0], [0, 1, 0, 0, 0, 0.0, 5.0]]
    logs = dict(columns=columns, runs={"2": {"no_spec": [run[:2], run, run]}})
    engine = ("static (DSparkEngine(static=True), inductor, one compilation per row prefix, admission_batch 1, "
              "admission_rows 16, one engine per policy)")
    settings = dict(max_new_tokens=8, length_spread=0.5, requests_per_slot=2, min_requests=0, engine=engine)
    results = dict(models={"smoke": dict(settings=settings, results={"no_spec": [
        dict(concurrency=2, other_ms_per_round=0.5)]})})
    with gzip.open(tmp_path / "cells.json.gz", "wt") as file:
        json.dump(logs, file)
    (tmp_path / "cells.json").write_text(json.dumps(results))
    monkeypatch.setattr(sys, "argv", ["admission_replay.py", str(tmp_path / "cells.json.gz"),
                                      "--out", str(tmp_path / "replay.json")])
    admission_replay.main()
    cell = json.loads((tmp_path / "replay.json").read_text())["cells"]["2"]
    assert cell["costs"] == pytest.approx(dict(set_seconds=0.014, first_seconds=0.030, step_seconds=0.005))
    assert cell["round_seconds"] == pytest.approx(0.0055)
    assert set(cell["modelled"]) == {"1", "4", "16", "auto"} and cell["ran"] == "1" and cell["requests"] == 4
    assert cell["measured_seconds"] == pytest.approx([0.0865, 0.0865]) and cell["measured_joins"] == [3, 3]
    assert "c=   2" in capsys.readouterr().out
