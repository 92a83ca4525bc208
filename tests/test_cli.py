"""`dspark-hf` subcommands on a tiny saved target (with a character tokenizer) and drafter."""

from __future__ import annotations

import json

import pytest
from tiny_models import char_tokenizer, install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_target

from dspark_hf.cli import main


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pair")
    target = make_bigram_like(tiny_target("qwen3", vocab_size=96, eos_token_id=2))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=96), target, scale=6.0)
    target.save_pretrained(folder / "target")
    char_tokenizer().save_pretrained(folder / "target")
    drafter.save_pretrained(folder / "drafter")
    return folder


def test_generate_prints_text_tau_and_speeds(saved_pair, capsys):
    code = main(["generate", "--target", str(saved_pair / "target"), "--drafter", str(saved_pair / "drafter"),
                 "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tokens/s" in out and "tau (accepted length per round" in out
    assert "identical to plain decoding: True" in out


def test_calibrate_writes_outputs(saved_pair, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"x = {i} + "}) + "\n" for i in range(10)))
    code = main(["calibrate", "--target", str(saved_pair / "target"), "--drafter", str(saved_pair / "drafter"),
                 "--prompts", str(prompts), "--temperature", "1.0", "--output", str(tmp_path / "out"),
                 "--max-new-tokens", "16", "--device", "cpu"])
    assert code == 0
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"drafter", "metrics.json", "reliability.png"}
    assert "sts_temperatures" in capsys.readouterr().out


def test_convert_to_deepspec_and_back(saved_pair, tmp_path):
    assert main(["convert", str(saved_pair / "drafter"), str(tmp_path / "deepspec"), "--to", "deepspec",
                 "--target", str(saved_pair / "target")]) == 0
    exported = json.loads((tmp_path / "deepspec" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3DSparkModel"] and exported["model_type"] == "qwen3"
    assert main(["convert", str(tmp_path / "deepspec"), str(tmp_path / "native")]) == 0
    assert json.loads((tmp_path / "native" / "config.json").read_text())["model_type"] == "dspark"


def test_demo_runs_offline(capsys):
    assert main(["demo", "--max-new-tokens", "12"]) == 0
    assert "identical" in capsys.readouterr().out
