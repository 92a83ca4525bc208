"""Checkpoints written in exactly DeepSpec's published layout load with no conversion and run; ours round-trip."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import tiny_target

import dspark_hf
from dspark_hf import DSparkDraftModel

H, HEADS, KV, HD, INTER, V, LAYERS, RANK = 32, 4, 2, 8, 64, 96, 2, 8


def deepspec_config(dspark: bool) -> dict:
    """The fields of `deepseek-ai/dspark_qwen3_4b_block7`'s config.json at tiny sizes (DFlash: heads off)."""
    config = {
        "architectures": ["Qwen3DSparkModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": 7,
        "bos_token_id": 1,
        "dtype": "bfloat16",
        "enable_confidence_head": dspark,
        "eos_token_id": 2,
        "head_dim": HD,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "layer_types": ["full_attention"] * LAYERS,
        "markov_rank": RANK if dspark else 0,
        "mask_token_id": 3,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_anchors": 512,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV,
        "num_target_layers": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "sliding_window": None,
        "target_layer_ids": [0, 2],
        "tie_word_embeddings": False,
        "transformers_version": "5.10.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": V,
    }
    if dspark:
        config.update(markov_head_type="vanilla", confidence_head_with_markov=True)
    return config


def deepspec_state_dict(dspark: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Exactly the published key names and shapes (§3.1 of the DeepSpec reference), in bf16."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 0.05).to(torch.bfloat16)

    state = {"embed_tokens.weight": rand(V, H), "lm_head.weight": rand(V, H), "fc.weight": rand(H, 2 * H),
             "hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16), "norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": rand(HEADS * HD, H), p + "self_attn.k_proj.weight": rand(KV * HD, H),
            p + "self_attn.v_proj.weight": rand(KV * HD, H), p + "self_attn.o_proj.weight": rand(H, HEADS * HD),
            p + "self_attn.q_norm.weight": torch.ones(HD, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(HD, dtype=torch.bfloat16),
            p + "mlp.gate_proj.weight": rand(INTER, H), p + "mlp.up_proj.weight": rand(INTER, H),
            p + "mlp.down_proj.weight": rand(H, INTER),
            p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        })
    if dspark:
        state.update({"markov_head.markov_w1.weight": rand(V, RANK), "markov_head.markov_w2.weight": rand(V, RANK),
                      "confidence_head.proj.weight": rand(1, H + RANK), "confidence_head.proj.bias": rand(1)})
    return state


def write_checkpoint(folder, config: dict, state: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("dspark", [True, False], ids=["dspark", "dflash"])
def test_deepspec_layout_loads_unchanged_and_runs(tmp_path, dspark):
    state = deepspec_state_dict(dspark)
    write_checkpoint(tmp_path, deepspec_config(dspark), state)
    drafter = DSparkDraftModel.from_pretrained(tmp_path)
    assert drafter.dtype == torch.bfloat16
    assert drafter.config.is_dflash is (not dspark)
    assert drafter.config.rope_parameters["rope_theta"] == 1000000
    loaded = drafter.state_dict()
    assert set(loaded) == set(state)
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor), key

    target = tiny_target("qwen3", vocab_size=V)
    ids = torch.tensor([[5, 17, 33, 8]])
    reference = target.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafter), reference)
    assert drafter.generation_stats.rounds > 0 and max(drafter.generation_stats.drafted) == 7


def test_auto_classes_and_native_round_trip(tmp_path):
    from transformers import AutoConfig, AutoModel

    write_checkpoint(tmp_path / "src", deepspec_config(True), deepspec_state_dict(True))
    drafter = DSparkDraftModel.from_pretrained(tmp_path / "src")
    drafter.save_pretrained(tmp_path / "native")
    saved = json.loads((tmp_path / "native" / "config.json").read_text())
    assert saved["model_type"] == "dspark" and saved["architectures"] == ["DSparkDraftModel"]
    assert isinstance(AutoConfig.from_pretrained(tmp_path / "native"), dspark_hf.DSparkConfig)
    again = AutoModel.from_pretrained(tmp_path / "native")
    assert isinstance(again, DSparkDraftModel)
    reloaded, original = load_file(str(tmp_path / "native" / "model.safetensors")), drafter.state_dict()
    assert set(reloaded) == set(original)
    assert all(torch.equal(reloaded[k], original[k]) for k in reloaded)


def test_drafter_saved_without_embeddings_takes_the_targets(tmp_path):
    target = tiny_target("qwen3", vocab_size=V)
    state = deepspec_state_dict(True)
    del state["embed_tokens.weight"], state["lm_head.weight"]
    write_checkpoint(tmp_path, deepspec_config(True), state)
    drafter = DSparkDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert drafter.weights_from_target == {"embed_tokens", "lm_head"}
    with pytest.raises(ValueError, match="share_target_weights"):
        drafter(torch.tensor([[1, 3]]))
    ids = torch.tensor([[5, 17, 33, 8]])
    out = target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, target.generate(ids, max_new_tokens=10, do_sample=False))
    assert drafter.embed_tokens.weight is target.get_input_embeddings().weight
    assert drafter.lm_head.weight is target.get_output_embeddings().weight


def test_identical_embeddings_are_shared_not_duplicated():
    target = tiny_target("qwen3", vocab_size=V)
    from tiny_models import tiny_drafter

    drafter = tiny_drafter(target)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    assert drafter.share_target_weights(target) == ["embed_tokens"]  # lm_head differs: kept
    assert drafter.embed_tokens.weight is target.get_input_embeddings().weight
    assert drafter.lm_head.weight is not target.get_output_embeddings().weight


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def load_reports():
    """transformers' load-report warnings (its loggers do not propagate to pytest's caplog)."""
    handler = Records()
    reporter = logging.getLogger("transformers.modeling_utils")
    reporter.addHandler(handler)
    yield handler.messages
    reporter.removeHandler(handler)


def test_weights_left_to_the_target_are_not_reported_missing(tmp_path, load_reports):
    state = deepspec_state_dict(True)
    del state["embed_tokens.weight"], state["lm_head.weight"]
    write_checkpoint(tmp_path / "shared", deepspec_config(True), state)
    assert DSparkDraftModel.from_pretrained(tmp_path / "shared").weights_from_target == {"embed_tokens", "lm_head"}
    assert not [m for m in load_reports if "LOAD REPORT" in m]
    state["layers.1.mlp.extra.weight"] = torch.zeros(2)  # a wrong checkpoint: the report is shown, then the error
    write_checkpoint(tmp_path / "wrong", deepspec_config(True), state)
    with pytest.raises(ValueError, match="unexpected weights"):
        DSparkDraftModel.from_pretrained(tmp_path / "wrong")
    (report,) = [m for m in load_reports if "LOAD REPORT" in m]
    assert "extra" in report and str(tmp_path / "wrong") in report
