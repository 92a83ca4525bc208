"""`dspark-hf demo`: offline, under a minute, plain and DSpark side by side; the embedded-pair lookup; how the
per-round token colours are derived."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark_hf.demo import RoundRecorder, find_demo_models, load_demo_pair, token_kinds, token_pieces

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_COLOR": "1"}


def run_demo(tmp_path: Path, env_extra: dict, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, **OFFLINE, **env_extra}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "dspark_hf.cli", "demo", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=180)
    return result, time.perf_counter() - started


def test_demo_runs_offline_in_under_a_minute(tmp_path):
    result, seconds = run_demo(tmp_path, {"DSPARK_DEMO_MODELS": str(tmp_path / "absent")})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "tiny random-init pair" in out  # says it is the untrained fallback
    assert "=== plain decoding ===" in out and "=== DSpark ===" in out
    assert "plain" in out and "| DSpark" in out  # the side-by-side columns
    assert "speedup x" in out and "tau (accepted length per round" in out
    assert "acceptance per draft position: @1:" in out
    assert "identical to plain decoding: True" in out
    assert seconds < 60, f"the demo took {seconds:.0f} s"


@pytest.mark.skipif(find_demo_models() is None, reason="no embedded demo_models/ pair in this checkout yet")
def test_demo_with_the_embedded_pair_in_under_a_minute(tmp_path):
    result, seconds = run_demo(tmp_path, {"DSPARK_DEMO_MODELS": str(find_demo_models())})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "embedded pair from" in result.stdout and "identical to plain decoding: True" in result.stdout
    assert seconds < 60, f"the demo took {seconds:.0f} s"


def _tiny_embedded_pair(folder: Path) -> None:
    """A demo_models/ folder as scripts/build_demo_pair.py lays it out, at toy size (char tokenizer, random weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dspark_hf import DSparkConfig, DSparkDraftModel

    chars = ["<eos>", "<mask>"] + [chr(c) for c in range(32, 127)] + ["\n"]
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=0, pad_token_id=0,
                         bos_token_id=None, tie_word_embeddings=True)
    target = LlamaForCausalLM(config).eval()
    target.save_pretrained(folder / "target")
    tokenizer.save_pretrained(folder / "target")
    drafter_config = DSparkConfig.from_target_config(config, mask_token_id=1, num_hidden_layers=1, markov_rank=8,
                                                     block_size=4)
    DSparkDraftModel(drafter_config).eval().save_pretrained(folder / "drafter")


def test_demo_prefers_the_embedded_pair(tmp_path):
    models = tmp_path / "demo_models"
    _tiny_embedded_pair(models)
    assert find_demo_models(models) == models
    assert find_demo_models(tmp_path / "nothing-here") is None
    pair = load_demo_pair(demo_models=models)
    assert pair.trained and pair.name == "embedded demo pair"
    result, _ = run_demo(tmp_path, {"DSPARK_DEMO_MODELS": str(models)}, "--max-new-tokens", "12", "--prompt", "def f(")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"embedded pair from {models}" in result.stdout
    assert "identical to plain decoding: True" in result.stdout


def test_load_demo_pair_needs_both_ids():
    with pytest.raises(ValueError, match="both --target and --drafter"):
        load_demo_pair(target="some/target")


def test_token_kinds_per_round():
    assert token_kinds(None, 0, 1) == ["target"]  # the prefill's token
    assert token_kinds(0, 0, 1) == ["target"]  # nothing verified this round
    assert token_kinds(4, 4, 5) == ["accepted"] * 4 + ["bonus"]  # full accept + bonus
    assert token_kinds(4, 2, 3) == ["accepted", "accepted", "corrected"]  # rejection at draft 3
    assert token_kinds(4, 0, 1) == ["corrected"]
    assert token_kinds(4, 3, 3) == ["accepted"] * 3  # accepted eos: no bonus


def test_round_recorder_pairs_chunks_with_stats():
    stats = SimpleNamespace(drafted=[3, 3, 2], accepted=[3, 1, 0], committed=[4, 2, 1])
    recorder = RoundRecorder(SimpleNamespace(generation_stats=stats))
    for chunk in ([5, 6, 7], [9], [1, 2, 3, 4], [8, 8], [7]):  # prompt, prefill token, three rounds
        recorder.put(torch.tensor(chunk))
    recorder.end()
    kinds = [kind for _, kind in recorder.segments()]
    assert kinds == ["target", "accepted", "accepted", "accepted", "bonus", "accepted", "corrected", "corrected"]
    assert recorder.token_ids == [9, 1, 2, 3, 4, 8, 8, 7] and recorder.finished
    # while the round's accepted count is not yet recorded, it is inferred from the committed length
    stats.accepted = stats.accepted[:2]
    assert [kind for _, kind in recorder.segments()][-1] == "corrected"
    plain = RoundRecorder(None)
    plain.put(torch.tensor([1]))
    plain.put(torch.tensor([2]))
    assert plain.segments() == [(2, "plain")]


def test_token_pieces_join_up():
    from dspark_hf.demo import ByteTokenizer

    tokenizer = ByteTokenizer()
    ids = tokenizer("a(b)\n")["input_ids"] + [200]
    assert "".join(token_pieces(tokenizer, ids)) == tokenizer.decode(ids) == "a(b)\n⟨200⟩"


FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "code-llama-50m"


@pytest.mark.fixtures
@pytest.mark.skipif(not (FIXTURE / "tokenizer.json").is_file(), reason="needs ../shared/fixtures (SmolLM2 tokenizer)")
def test_build_demo_pair_script_smoke(tmp_path):
    """scripts/build_demo_pair.py's train and check phases at toy size on real Python text (the GPU run is the same
    code with real sizes); `prepare` is skipped: it scans every local wheel for the corpus."""
    import inspect
    import json
    import lzma
    import shutil
    import textwrap

    work, models = tmp_path / "work", tmp_path / "demo_models"
    work.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, work / name)
    documents = [inspect.getsource(shutil), inspect.getsource(textwrap)]
    with lzma.open(work / "corpus.txt.xz", "wt") as handle:
        handle.write("\0".join(documents))
    with lzma.open(work / "corpus.holdout.txt.xz", "wt") as handle:
        handle.write(documents[1])
    script = Path(__file__).resolve().parents[1] / "scripts" / "build_demo_pair.py"
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}
    for phase in (["train", "--work", str(work), "--out", str(models)], ["check", "--models", str(models)]):
        result = subprocess.run([sys.executable, str(script), *phase, "--smoke"], env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert find_demo_models(models) == models
    report = json.loads((models / "build_report.json").read_text())
    assert report["target"]["size_mib"] < 32 and report["target"]["steps"] == 3
    check = json.loads((models / "check.smoke.json").read_text())
    assert check["runs"] and all(run["identical"] for run in check["runs"] if run["temperature"] == 0)
