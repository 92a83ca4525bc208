"""benchmarks/round_speed.py on tiny float32 models (CPU): every method runs, and every one reproduces plain
decoding token for token (the GPU run reports the same `matched_plain` in bf16)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
round_speed = pytest.importorskip("round_speed")


def test_every_method_runs_and_matches_plain_decoding():
    target, drafter, prompt = round_speed.models("smoke", round_speed.torch.float32, "cpu")
    rows = round_speed.measure(target, drafter, prompt, new_tokens=12)
    assert set(rows) == {"plain_eager", "plain_static_compile", "dspark_generate", "dspark_static",
                         "dspark_static_compiled"}
    assert all(row["matched_plain"] == 1.0 and row["tokens_per_second"] > 0 for row in rows.values())
    assert all(rows[name]["rounds"] > 0 for name in rows if name.startswith("dspark"))
