"""benchmarks/round_speed.py on tiny float32 models (CPU): every method runs, and every one reproduces plain
decoding token for token (the GPU run reports the same `matched_plain` in bf16), at batch 1 and at a small batch.
The fixture's methods (the 10M assistant, HumanEval prompts in a left-padded batch) need ../shared."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
round_speed = pytest.importorskip("round_speed")
torch = round_speed.torch

BATCH_1 = {"plain_eager", "plain_static_compile", "plain_static", "plain_static_compiled", "dspark_generate",
           "dspark_static", "dspark_static_compiled", "prompt_lookup"}
BATCHED = {"plain_eager", "plain_static_compile", "dspark_engine", "engine_no_spec", "plain_static",
           "plain_static_compiled", "dspark_static", "dspark_static_compiled", "dspark_static_refill_compiled"}
needs_fixtures = pytest.mark.skipif(not (round_speed.REPO.parent / "shared" / "fixtures").is_dir(),
                                    reason="needs ../shared/fixtures (the 50M code fixture and its 10M assistant)")


@pytest.fixture(scope="module")
def smoke():
    return round_speed.models("smoke", torch.float32, "cpu")


def test_every_method_runs_and_matches_plain_decoding(smoke):
    target, drafter, prompt = smoke
    rows = round_speed.measure(target, drafter, prompt, new_tokens=12)
    assert set(rows) == BATCH_1
    assert all(row["matched_plain"] == 1.0 and row["tokens_per_second"] > 0 for row in rows.values())
    assert all(rows[name]["rounds"] > 0 for name in rows if name.startswith("dspark"))
    assert all(rows[name]["ms_per_steady_round"] > 0 for name in ("dspark_static", "dspark_static_compiled"))
    assert all(0 < rows[name]["prefill_ms"] for name in ("plain_static", "plain_static_compiled"))
    assert not {"prefill_ms", "ms_per_steady_token"} & set(rows["plain_static_compile"])  # transformers' own loop
    lookup = rows["prompt_lookup"]  # τ from the target's forward count: at least one token per forward
    assert 1 <= lookup["rounds"] <= 12 and lookup["tau"] == pytest.approx(12 / lookup["rounds"])


def test_batched_methods_run_and_match_plain_decoding(smoke):
    target, drafter, prompt = smoke
    prompts = round_speed.batch_prompts("smoke", target, prompt, batch=4, new_tokens=10)
    rows = round_speed.measure_batch(target, drafter, prompts, new_tokens=10)
    assert set(rows) == BATCHED
    for name, row in rows.items():
        requests = 8 if "refill" in name else 4  # the refill method decodes the prompts twice through 4 rows
        assert row["matched_plain_min"] == 1.0 and row["generated_tokens"] == requests * 10
        assert row["tokens_per_second"] > 0
    assert rows["dspark_static_refill_compiled"]["tau"] >= 1
    for name in ("dspark_engine", "dspark_static", "dspark_static_compiled"):
        assert rows[name]["rounds"] > 0 and rows[name]["tau"] >= 1
    assert rows["engine_no_spec"]["tau"] == 1.0


def test_left_padded_rows_of_different_lengths_match_plain_decoding(smoke):
    target, drafter, prompt = smoke
    ids = prompt[0].tolist()
    prompts = [ids, ids[5:], ids[2:] + ids[:3], ids[9:]]
    rows = round_speed.measure_batch(target, drafter, prompts, new_tokens=8)
    assert all(row["matched_plain_min"] == 1.0 for row in rows.values())


def test_not_measured_names_a_reason_for_every_skipped_method():
    for name in ("smoke", "code50m"):
        skipped = round_speed.not_measured(name, 1)
        assert "dflash_native" in skipped and not set(skipped) & BATCH_1
        assert ("assisted_10m" in skipped) == (name != "code50m")
        batched = round_speed.not_measured(name, 64)
        assert {"prompt_lookup", "assisted_10m"} <= set(batched) and not set(batched) & BATCHED
        assert all(isinstance(reason, str) and reason for reason in (*skipped.values(), *batched.values()))


def test_smoke_run_writes_batch_1_and_batch_4(tmp_path, monkeypatch):
    out = tmp_path / "round_speed.json"
    monkeypatch.setattr(sys, "argv", ["round_speed.py", "--model", "smoke", "--device", "cpu", "--new-tokens", "6",
                                      "--batch", "1,4", "--out", str(out)])
    round_speed.main()
    entry = json.loads(out.read_text())["models"]["smoke"]
    assert set(entry["methods"]) == BATCH_1 and set(entry["batch_4"]["methods"]) == BATCHED
    assert entry["batch_4"]["batch"] == 4 and "not_measured" in entry and "not_measured" in entry["batch_4"]
    monkeypatch.setattr(sys, "argv", ["round_speed.py", "--model", "smoke", "--device", "cpu", "--new-tokens", "6",
                                      "--out", str(out), "--inductor", "combo_kernels=0"])  # (inductor's default)
    round_speed.main()  # a batch-1 run keeps the batch-4 entry
    entry = json.loads(out.read_text())["models"]["smoke"]
    assert "batch_4" in entry and entry["inductor_settings"] == ["combo_kernels=0"]
    assert out.with_suffix(".png").exists()


@needs_fixtures
def test_fixture_assistant_and_batched_prompts_match_plain_decoding():
    target, drafter, prompt = round_speed.models("code50m", torch.float32, "cpu", new_tokens=4)
    assistant = round_speed.assistant_model("code50m", torch.float32, "cpu")
    rows = round_speed.measure(target, drafter, prompt, new_tokens=4, assistant=assistant)
    assert set(rows) == BATCH_1 | {"assisted_10m"}
    assert all(row["matched_plain"] == 1.0 for row in rows.values())
    assert rows["assisted_10m"]["rounds"] >= 1 and rows["assisted_10m"]["assistant"]["parameters"] > 0
    prompts = round_speed.batch_prompts("code50m", target, prompt, batch=2, new_tokens=4)
    assert len(prompts) == 2 and len(set(map(tuple, prompts))) == 2
    rows = round_speed.measure_batch(target, drafter, prompts, new_tokens=4)
    assert all(row["matched_plain_min"] == 1.0 for row in rows.values())


def test_summary_compares_with_the_fastest_plain_method_and_the_floor():
    def rows(**tps):
        return {name: dict(tokens_per_second=v, ms_per_token=1e3 / v) for name, v in tps.items()}

    fixture = rows(plain_eager=100.0, plain_static_compile=400.0, plain_static_compiled=500.0,
                   dspark_static_compiled=1000.0)
    fixture["dspark_static_compiled"].update(tau=4.0)
    shape = rows(plain_static_compiled=250.0, dspark_static_compiled=100.0)
    shape["dspark_static_compiled"].update(ms_per_round=6.0)
    summary = round_speed.summarize({"code50m": dict(methods=fixture),
                                     "qwen3-4b-shape": dict(floor_ms=2.0, round_floor_ms=2.5, methods=shape)})
    assert summary["fast_plain_method"] == "plain_static_compiled"
    assert summary["speedup_over_fast_plain"] == pytest.approx(2.0) and summary["speedup_goal"] == pytest.approx(3.2)
    assert summary["round_time_over_floor_4b"] == pytest.approx(3.0)
    assert summary["round_time_over_round_floor_4b"] == pytest.approx(2.4)
    assert summary["plain_step_over_floor_4b"] == pytest.approx(2.0)
    assert "round_time_over_floor_8b" not in summary


@pytest.mark.parametrize("name", sorted(round_speed.SHAPES))
def test_every_random_shape_has_a_config(name):
    config = round_speed.shape_config(name)
    assert config.eos_token_id is None and config.max_position_embeddings == 4096
    assert config.hidden_size == round_speed.SHAPES[name]["hidden_size"]


def test_round_stages_benchmark_runs_and_plots(tmp_path):
    """benchmarks/round_stages.py: every stage timed for the smoke shape, the plot written."""
    round_stages = pytest.importorskip("round_stages")
    entry = round_stages.measure("smoke", torch.float32, "cpu", rounds=2)
    assert set(entry["stages_ms"]) == set(round_stages.ROUND_STAGES) and entry["fused_round_ms"] > 0
    assert entry["split_round_ms"] == pytest.approx(sum(entry["stages_ms"].values())) and entry["tau"] >= 1
    round_stages.plot({"smoke": entry}, tmp_path / "stages.png")
    assert (tmp_path / "stages.png").stat().st_size > 0


def test_benchmark_scratch_folders_are_removed_when_the_process_exits():
    """Materialized fixtures (~200 MB each) go to `common.scratch_dir`: left behind by every run, they filled CI's
    disk once."""
    import subprocess

    code = ("import sys; sys.path.insert(0, sys.argv[1]); from common import scratch_dir; "
            "path = scratch_dir('scratch-test-'); (path / 'weights.bin').write_bytes(b'0' * 1024); print(path)")
    printed = subprocess.run([sys.executable, "-c", code, str(round_speed.REPO / "benchmarks")], check=True,
                             capture_output=True, text=True).stdout.strip()
    assert printed and not Path(printed).exists()


def test_fast_path_setup_times_the_set_up_both_ways(smoke, monkeypatch):
    """benchmarks/fast_path_setup.py: in `walk` blocks `fuse_projections` finds no record of its last call (so it
    walks the models), in `record` blocks it does."""
    fast_path_setup = pytest.importorskip("fast_path_setup")
    fusion = fast_path_setup.fused_projections
    target, drafter, prompt = smoke
    found, fuse = [], fusion.fuse_projections
    monkeypatch.setattr(fusion, "fuse_projections", lambda model: found.append(model in fusion._fused_groups)
                        or fuse(model))
    times = fast_path_setup.measure(target, drafter, prompt.shape[1], calls=3, repeats=2)
    assert {"record", "walk", "capture_key", "share_target_weights"} <= set(times)
    assert all(value > 0 for value in times.values())
    # per block: 3 calls x 2 models; the parts' own fuse_projections calls (3 per model and block) find a record
    assert found.count(False) >= 2 * 3 * 2 and found.count(True) >= 2 * 3 * 2 * 2


def test_the_round_floor_counts_the_drafters_weights_but_its_embedding(smoke):
    target, drafter = smoke[:2]
    floor = round_speed.weight_read_floor(target, drafter)
    expected = sum(p.numel() * 4 for name, p in drafter.named_parameters() if not name.startswith("embed_tokens"))
    assert floor["drafter_weight_bytes"] == expected > 0
    assert floor["weight_bytes"] == sum(p.numel() * 4 for p in target.parameters())
    assert floor["floor_ms"] is None and floor["round_floor_ms"] is None  # no bandwidth measured on the CPU
    own_head, drafter.lm_head.weight = drafter.lm_head.weight, target.lm_head.weight  # the target's head, shared:
    try:  # the draft reads it as well as the verify, so it still counts
        assert round_speed.weight_read_floor(target, drafter)["drafter_weight_bytes"] == expected
        drafter.lm_head.weight = drafter.embed_tokens.weight  # tied to the drafter's embedding: the head counts
        assert round_speed.weight_read_floor(target, drafter)["drafter_weight_bytes"] == expected
    finally:
        drafter.lm_head.weight = own_head


def test_the_committed_rows_round_floors_count_on_meta_and_agree_with_the_committed_summary(capsys):
    round_floor = pytest.importorskip("round_floor")
    if not round_floor.SOURCE.is_file():
        pytest.skip("no committed round_speed_h200.json")
    round_floor.main()
    models = json.loads(capsys.readouterr().out)["models"]
    summary = json.loads(round_floor.SOURCE.read_text())
    for label, name in (("4b", "qwen3-4b-shape"), ("8b", "qwen3-8b-shape")):
        row = models[name]
        assert row["round_time_over_floor"] == pytest.approx(summary[f"round_time_over_floor_{label}"])
        assert row["drafter_weight_bytes"] > 0 and row["round_time_over_round_floor"] < row["round_time_over_floor"]
