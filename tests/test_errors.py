"""Clear errors, raised before any work: misfit drafters, broken checkpoints, modes DSpark can't serve."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_checkpoints import deepspec_config, deepspec_state_dict, write_checkpoint
from tiny_models import tiny_drafter, tiny_target

import dspark_hf
from dspark_hf import DSparkConfig, DSparkDraftModel

IDS = torch.tensor([[5, 17, 33, 8]])


@pytest.fixture
def counted_target(monkeypatch):
    """A target whose forward calls are counted, to prove errors come before any work."""
    target = tiny_target("qwen3")
    calls = []
    original = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    return target, calls


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(vocab_size=100), "vocab size"),
        (dict(hidden_size=64), "hidden size"),
        (dict(target_layer_ids=[-2, 0]), "outside the target's layers"),
        (dict(target_layer_ids=[0, 9]), "outside the target's layers"),
        (dict(num_target_layers=36), "layer count"),
    ],
)
def test_drafter_that_does_not_fit_the_target(counted_target, overrides, message):
    target, calls = counted_target
    config = tiny_drafter(target).config.to_dict()
    config.update(overrides)
    if "hidden_size" in overrides:
        config.update(num_attention_heads=8, head_dim=8)
    drafter = DSparkDraftModel(DSparkConfig.from_dict(config))
    with pytest.raises(ValueError, match=message):
        target.generate(IDS, max_new_tokens=5, assistant_model=drafter)
    assert calls == []


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_beams=2), "beam"),
        (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
        (dict(assistant_ensemble_weight=0.5), "lossy"),
        (dict(speculation_type="dflash"), "speculation_type"),  # transformers' DFlash path, not ours
    ],
)
def test_generation_modes_dspark_cannot_serve(counted_target, kwargs, message):
    target, calls = counted_target
    with pytest.raises(ValueError, match=message):
        target.generate(IDS, max_new_tokens=5, assistant_model=tiny_drafter(target), **kwargs)
    assert calls == []


def test_missing_and_unexpected_weights(tmp_path):
    state = deepspec_state_dict(True)
    del state["layers.1.mlp.up_proj.weight"]
    state["layers.1.mlp.extra.weight"] = torch.zeros(2)
    write_checkpoint(tmp_path, deepspec_config(True), state)
    with pytest.raises(ValueError, match=r"missing weights: \['layers.1.mlp.up_proj.weight'\].*unexpected"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_config_and_weights_disagree(tmp_path):
    config = deepspec_config(True)
    config["markov_rank"] = 0  # the weights still carry a Markov head
    write_checkpoint(tmp_path, config, deepspec_state_dict(True))
    with pytest.raises(ValueError, match="unexpected weights"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_corrupt_weights_file(tmp_path):
    write_checkpoint(tmp_path, deepspec_config(False), deepspec_state_dict(False))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated download
    with pytest.raises(ValueError, match="corrupt"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_pickle_checkpoints_are_never_loaded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(deepspec_config(False)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="safetensors"):
        DSparkDraftModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="safetensors"):
        DSparkDraftModel.from_pretrained(tmp_path, use_safetensors=False)


def test_unknown_format_names_the_known_ones(tmp_path):
    config = deepspec_config(True)
    config["architectures"] = ["MedusaModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="Qwen3DSparkModel"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_bad_config_values():
    with pytest.raises(ValueError, match="markov_head_type"):
        DSparkConfig(markov_head_type="lstm", target_layer_ids=[0], mask_token_id=1)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DSparkDraftModel(DSparkConfig(hidden_size=32, num_attention_heads=4, head_dim=8, mask_token_id=1))


def test_drafter_is_not_a_standalone_lm():
    drafter = tiny_drafter(tiny_target("qwen3"))
    with pytest.raises(RuntimeError, match="assistant_model"):
        drafter.generate(IDS)
    assert dspark_hf.DSparkDraftModel.hook_unavailable_reason is None
