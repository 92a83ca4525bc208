"""Published drafter layouts at tiny sizes: DeepSpec Gemma4 and z-lab DFlash load, their block logits equal the
reference math written out here, they drive a target losslessly, and export/import round-trips bit-exactly."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import tiny_drafter, tiny_gemma4_target, tiny_target

import dspark_hf
import dspark_hf.checkpoints as ck
from dspark_hf import DSparkDraftModel

H, V, LAYERS, RANK = 32, 96, 2, 8
G_HEADS, G_GLOBAL_HD, G_INTER = 4, 16, 64


def write(folder, config: dict, state: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def rand_factory(seed: int, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    return lambda *shape, scale=0.2: (torch.randn(*shape, generator=generator) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------------- Gemma4
def gemma4_config(dspark: bool = True) -> dict:
    """`deepseek-ai/dspark_gemma4_12b_block7`'s config.json fields (reference §3.5) at tiny sizes."""
    config = {
        "architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_text", "attention_bias": False,
        "attention_dropout": 0.0, "attention_k_eq_v": True, "block_size": 7, "bos_token_id": 2,
        "dtype": "bfloat16", "enable_confidence_head": dspark, "eos_token_id": 1, "final_logit_softcapping": 30.0,
        "global_head_dim": G_GLOBAL_HD, "head_dim": 8, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": H,
        "hidden_size_per_layer_input": 0, "enable_moe_block": False, "initializer_range": 0.02,
        "intermediate_size": G_INTER, "layer_types": ["full_attention"] * LAYERS, "mask_token_id": 4,
        "markov_rank": RANK if dspark else 0, "max_position_embeddings": 131072, "num_anchors": 512,
        "num_attention_heads": G_HEADS, "num_global_key_value_heads": 1, "num_hidden_layers": LAYERS,
        "num_key_value_heads": 2, "num_target_layers": 4, "pad_token_id": 0, "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": 1024, "target_layer_ids": [0, 2], "target_model_type": "gemma4_unified",
        "target_text_model_type": "gemma4_unified_text", "tie_word_embeddings": False,
        "transformers_version": "5.10.2", "vocab_size": V,
    }
    if dspark:
        config.update(markov_head_type="vanilla", confidence_head_with_markov=True)
    return config


def gemma4_state(dspark: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Exactly DeepSpec Gemma4DSparkModel's keys: no v_proj, a persistent `layer_scalar` [1] per layer."""
    rand = rand_factory(seed)
    hd, q = G_GLOBAL_HD, G_HEADS * G_GLOBAL_HD
    state = {"embed_tokens.weight": rand(V, H, scale=0.05), "lm_head.weight": rand(V, H), "fc.weight": rand(H, 2 * H),
             "hidden_norm.weight": 1 + rand(H), "norm.weight": 1 + rand(H)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": rand(q, H), p + "self_attn.k_proj.weight": rand(hd, H),
            p + "self_attn.o_proj.weight": rand(H, q), p + "self_attn.q_norm.weight": 1 + rand(hd),
            p + "self_attn.k_norm.weight": 1 + rand(hd), p + "mlp.gate_proj.weight": rand(G_INTER, H),
            p + "mlp.up_proj.weight": rand(G_INTER, H), p + "mlp.down_proj.weight": rand(H, G_INTER),
            p + "input_layernorm.weight": 1 + rand(H), p + "post_attention_layernorm.weight": 1 + rand(H),
            p + "pre_feedforward_layernorm.weight": 1 + rand(H), p + "post_feedforward_layernorm.weight": 1 + rand(H),
            p + "layer_scalar": torch.tensor([0.5 + 0.25 * i], dtype=torch.bfloat16),
        })
    if dspark:
        state.update({"markov_head.markov_w1.weight": rand(V, RANK), "markov_head.markov_w2.weight": rand(V, RANK),
                      "confidence_head.proj.weight": rand(1, H + RANK), "confidence_head.proj.bias": rand(1)})
    return state


def rms(x, weight=None, eps=1e-6):
    x = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return x if weight is None else x * weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def gemma4_reference_hidden(state, ids, features, context_pos, block_pos):
    """Gemma4 DSpark block forward written out (reference §3.5), float32."""
    s = {k: v.float() for k, v in state.items()}
    hd = G_GLOBAL_HD
    angles = int(0.25 * hd // 2)
    inv = torch.zeros(hd // 2)
    inv[:angles] = 1.0 / (1e6 ** (torch.arange(0, 2 * angles, 2).float() / hd))

    def rope(x, pos):  # x [T, heads, hd]
        freqs = pos[:, None].float() * inv[None]
        emb = torch.cat([freqs, freqs], -1)[:, None]
        return x * emb.cos() + rotate_half(x) * emb.sin()

    x = s["embed_tokens.weight"][ids] * math.sqrt(H)
    ctx = rms(features @ s["fc.weight"].T, s["hidden_norm.weight"])
    for i in range(LAYERS):
        p = f"layers.{i}."
        h = rms(x, s[p + "input_layernorm.weight"])
        q = rope(rms((h @ s[p + "self_attn.q_proj.weight"].T).view(-1, G_HEADS, hd), s[p + "self_attn.q_norm.weight"]),
                 block_pos)
        both = torch.cat([ctx, h])
        raw = (both @ s[p + "self_attn.k_proj.weight"].T).view(-1, 1, hd)
        k = rope(rms(raw, s[p + "self_attn.k_norm.weight"]), torch.cat([context_pos, block_pos]))
        v = rms(raw)  # weightless v_norm of the raw k_proj output (k = v)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k.expand(-1, G_HEADS, -1)) * 1.0, dim=-1)
        out = torch.einsum("hqk,khd->qhd", att, v.expand(-1, G_HEADS, -1)).reshape(len(ids), -1)
        x = x + rms(out @ s[p + "self_attn.o_proj.weight"].T, s[p + "post_attention_layernorm.weight"])
        m = rms(x, s[p + "pre_feedforward_layernorm.weight"])
        m = (torch.nn.functional.gelu(m @ s[p + "mlp.gate_proj.weight"].T, approximate="tanh")
             * (m @ s[p + "mlp.up_proj.weight"].T)) @ s[p + "mlp.down_proj.weight"].T
        x = (x + rms(m, s[p + "post_feedforward_layernorm.weight"])) * s[p + "layer_scalar"]
    return rms(x, s["norm.weight"])


def test_gemma4_layout_loads_and_matches_reference_math(tmp_path):
    state, config = gemma4_state(), gemma4_config()
    write(tmp_path, config, state)
    assert ck.detect_format(tmp_path) == "deepspec-gemma4"
    drafter = DSparkDraftModel.from_pretrained(tmp_path)
    assert type(drafter).__name__ == "Gemma4DSparkDraftModel" and drafter.dtype == torch.bfloat16
    loaded = drafter.state_dict()
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)

    drafter = DSparkDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    gamma, ctx_len = 7, 5
    features = torch.randn(1, ctx_len, 2 * H, generator=torch.Generator().manual_seed(3))
    anchor = torch.tensor([9])
    from transformers.cache_utils import DynamicCache

    proposal = drafter.draft(anchor, features, DynamicCache(), position_ids=torch.arange(ctx_len, ctx_len + gamma)[None],
                             context_position_ids=torch.arange(ctx_len)[None])
    ids = torch.tensor([9] + [4] * (gamma - 1))
    hidden = gemma4_reference_hidden(state, ids, features[0], torch.arange(ctx_len), torch.arange(ctx_len, ctx_len + gamma))
    s = {k: v.float() for k, v in state.items()}
    base = torch.tanh((hidden @ s["lm_head.weight"].T) / 30.0) * 30.0
    prev = torch.cat([anchor, proposal.tokens[0, :-1]])
    expected = base + s["markov_head.markov_w1.weight"][prev] @ s["markov_head.markov_w2.weight"].T
    torch.testing.assert_close(proposal.logits[0], expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(proposal.tokens[0], expected.argmax(-1))
    conf = torch.cat([hidden, s["markov_head.markov_w1.weight"][prev]], -1) @ s["confidence_head.proj.weight"].T
    torch.testing.assert_close(proposal.confidence_logits[0], conf[:, 0] + s["confidence_head.proj.bias"], rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("dspark", [True, False], ids=["dspark", "dflash"])
def test_gemma4_drafter_with_gemma_target_is_lossless(tmp_path, dspark):
    write(tmp_path, gemma4_config(dspark), gemma4_state(dspark))
    drafter = DSparkDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert drafter.config.is_dflash is (not dspark)
    target = tiny_gemma4_target()
    generator = torch.Generator().manual_seed(1)
    for n in (1, 4, 9):
        ids = torch.randint(5, V, (1, n), generator=generator)
        reference = target.generate(ids, max_new_tokens=14, do_sample=False)
        assert torch.equal(target.generate(ids, max_new_tokens=14, do_sample=False, assistant_model=drafter), reference)
    assert max(drafter.generation_stats.drafted) == 7


def test_gemma4_export_import_round_trip(tmp_path):
    write(tmp_path / "src", gemma4_config(), gemma4_state())
    drafter = DSparkDraftModel.from_pretrained(tmp_path / "src")
    ck.convert(tmp_path / "src", tmp_path / "native")
    ck.convert(tmp_path / "native", tmp_path / "deepspec", to="deepspec")
    exported = json.loads((tmp_path / "deepspec" / "config.json").read_text())
    original = gemma4_config()
    assert exported["architectures"] == ["Gemma4DSparkModel"] and exported["model_type"] == "gemma4_text"
    for key, value in original.items():
        if key not in ("transformers_version",):
            assert exported[key] == value, key
    weights = load_file(str(tmp_path / "deepspec" / "model.safetensors"))
    source = gemma4_state()
    assert set(weights) == set(source) and all(torch.equal(weights[k], source[k]) for k in source)
    again = DSparkDraftModel.from_pretrained(tmp_path / "deepspec")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), drafter.state_dict().values()))


# ---------------------------------------------------------------------------------------------------- z-lab
Q_HEADS, Q_KV, Q_HD, Q_INTER = 4, 2, 8, 64


def zlab_config(block_size: int = 16) -> dict:
    """`z-lab/Qwen3-*-DFlash-b16` config.json (reference §13.1) at tiny sizes: written by transformers 4.57."""
    return {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "block_size": block_size,
        "bos_token_id": 1, "eos_token_id": 2, "head_dim": Q_HD, "hidden_act": "silu", "hidden_size": H,
        "initializer_range": 0.02, "intermediate_size": Q_INTER, "max_position_embeddings": 40960,
        "num_attention_heads": Q_HEADS, "num_hidden_layers": LAYERS, "num_key_value_heads": Q_KV,
        "num_target_layers": 4, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
        "use_cache": True, "vocab_size": V, "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 2]},
    }


def zlab_state(seed: int = 0) -> dict[str, torch.Tensor]:
    rand = rand_factory(seed)
    state = {"fc.weight": rand(H, 2 * H), "hidden_norm.weight": 1 + rand(H), "norm.weight": 1 + rand(H)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": rand(Q_HEADS * Q_HD, H), p + "self_attn.k_proj.weight": rand(Q_KV * Q_HD, H),
            p + "self_attn.v_proj.weight": rand(Q_KV * Q_HD, H), p + "self_attn.o_proj.weight": rand(H, Q_HEADS * Q_HD),
            p + "self_attn.q_norm.weight": 1 + rand(Q_HD), p + "self_attn.k_norm.weight": 1 + rand(Q_HD),
            p + "mlp.gate_proj.weight": rand(Q_INTER, H), p + "mlp.up_proj.weight": rand(Q_INTER, H),
            p + "mlp.down_proj.weight": rand(H, Q_INTER), p + "input_layernorm.weight": 1 + rand(H),
            p + "post_attention_layernorm.weight": 1 + rand(H),
        })
    return state


def qwen3_reference_hidden(state, embed, ids, features, context_pos, block_pos):
    s = {k: v.float() for k, v in state.items()}
    inv = 1.0 / (1e6 ** (torch.arange(0, Q_HD, 2).float() / Q_HD))

    def rope(x, pos):
        freqs = pos[:, None].float() * inv[None]
        emb = torch.cat([freqs, freqs], -1)[:, None]
        return x * emb.cos() + rotate_half(x) * emb.sin()

    x = embed[ids]
    ctx = rms(features @ s["fc.weight"].T, s["hidden_norm.weight"])
    groups = Q_HEADS // Q_KV
    for i in range(LAYERS):
        p = f"layers.{i}."
        h = rms(x, s[p + "input_layernorm.weight"])
        q = rope(rms((h @ s[p + "self_attn.q_proj.weight"].T).view(-1, Q_HEADS, Q_HD), s[p + "self_attn.q_norm.weight"]),
                 block_pos)
        both = torch.cat([ctx, h])
        k = rope(rms((both @ s[p + "self_attn.k_proj.weight"].T).view(-1, Q_KV, Q_HD), s[p + "self_attn.k_norm.weight"]),
                 torch.cat([context_pos, block_pos])).repeat_interleave(groups, 1)
        v = (both @ s[p + "self_attn.v_proj.weight"].T).view(-1, Q_KV, Q_HD).repeat_interleave(groups, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(Q_HD), dim=-1)
        out = torch.einsum("hqk,khd->qhd", att, v).reshape(len(ids), -1)
        x = x + out @ s[p + "self_attn.o_proj.weight"].T
        m = rms(x, s[p + "post_attention_layernorm.weight"])
        x = x + (torch.nn.functional.silu(m @ s[p + "mlp.gate_proj.weight"].T) * (m @ s[p + "mlp.up_proj.weight"].T)) \
            @ s[p + "mlp.down_proj.weight"].T
    return rms(x, s["norm.weight"])


def test_zlab_layout_loads_and_drafts_block_minus_one_from_mask_slots(tmp_path):
    state = zlab_state()
    write(tmp_path, zlab_config(), state)
    assert ck.detect_format(tmp_path) == "zlab-dflash"
    drafter = DSparkDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    config = drafter.config
    assert (config.block_layout, config.block_size, config.num_draft_slots) == ("zlab", 16, 15)
    assert config.is_dflash and config.mask_token_id == 3 and config.rope_parameters["rope_theta"] == 1000000
    assert drafter.weights_from_target == {"embed_tokens", "lm_head"}
    target = tiny_target("qwen3", vocab_size=V)
    drafter.share_target_weights(target)
    embed, head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()

    from transformers.cache_utils import DynamicCache

    ctx_len = 6
    features = torch.randn(1, ctx_len, 2 * H, generator=torch.Generator().manual_seed(4))
    proposal = drafter.draft(torch.tensor([11]), features, DynamicCache(),
                             position_ids=torch.arange(ctx_len, ctx_len + 16)[None],
                             context_position_ids=torch.arange(ctx_len)[None])
    assert proposal.tokens.shape == (1, 15) and proposal.confidence_logits is None
    hidden = qwen3_reference_hidden(state, embed, torch.tensor([11] + [3] * 15), features[0], torch.arange(ctx_len),
                                    torch.arange(ctx_len, ctx_len + 16))
    expected = hidden[1:] @ head.T  # mask slot j (1..15) predicts its own position anchor + j
    torch.testing.assert_close(proposal.logits[0], expected, rtol=1e-4, atol=1e-4)


def test_zlab_drafter_with_qwen3_target_is_lossless_and_round_trips(tmp_path):
    write(tmp_path / "src", zlab_config(block_size=6), zlab_state())
    drafter = DSparkDraftModel.from_pretrained(tmp_path / "src", dtype=torch.float32)
    target = tiny_target("qwen3", vocab_size=V)
    generator = torch.Generator().manual_seed(2)
    for n in (1, 5, 10):
        ids = torch.randint(4, V, (1, n), generator=generator)
        reference = target.generate(ids, max_new_tokens=14, do_sample=False)
        assert torch.equal(target.generate(ids, max_new_tokens=14, do_sample=False, assistant_model=drafter), reference)
    assert max(drafter.generation_stats.drafted) == 5
    # z-lab -> native -> z-lab: same weights, same config fields
    ck.convert(tmp_path / "src", tmp_path / "native")
    assert json.loads((tmp_path / "native" / "config.json").read_text())["block_layout"] == "zlab"
    ck.convert(tmp_path / "native", tmp_path / "zlab", to="zlab")
    back = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert back["architectures"] == ["DFlashDraftModel"] and back["dflash_config"] == zlab_config()["dflash_config"]
    assert back["block_size"] == 6
    weights, source = load_file(str(tmp_path / "zlab" / "model.safetensors")), zlab_state()
    assert set(weights) == set(source) and all(torch.equal(weights[k], source[k]) for k in source)
    with pytest.raises(ValueError, match="z-lab"):
        ck.convert(tmp_path / "src", tmp_path / "bad", to="deepspec", target=target)


# ---------------------------------------------------------------------------------------------------- Qwen3, misc
def test_qwen3_drafter_exports_to_deepspec_and_back_bit_exactly(tmp_path):
    target = tiny_target("qwen3", vocab_size=V)
    drafter = tiny_drafter(target, block_size=5).to(torch.bfloat16)
    drafter.config.sts_temperatures = [1.0, 1.1, 1.2, 1.3, 1.4]
    ck.export_deepspec(drafter, tmp_path / "ds")
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert "backbone" not in config and config["dtype"] == "bfloat16" and config["markov_head_type"] == "vanilla"
    assert ck.detect_format(tmp_path / "ds") == "deepspec-qwen3"
    again = DSparkDraftModel.from_pretrained(tmp_path / "ds")
    assert again.config.sts_temperatures == [1.0, 1.1, 1.2, 1.3, 1.4]
    ours, theirs = drafter.state_dict(), again.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_unknown_formats_name_the_known_ones(tmp_path):
    for config, fragment in [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "LlamaForCausalLM"),
        ({"architectures": ["Qwen3Eagle3Model"], "model_type": "qwen3"}, "Eagle3"),
        ({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}, "without DSpark heads"),
        ({"architectures": ["DSparkDraftModel"], "speculators_config": {}}, "speculators"),
    ]:
        write(tmp_path, config, {"x": torch.zeros(1)})
        with pytest.raises(ValueError, match=fragment) as error:
            DSparkDraftModel.from_pretrained(tmp_path)
        for name in ck.FORMATS:
            assert name in str(error.value)


def test_convert_cli_parser_and_model_card(tmp_path, capsys):
    write(tmp_path / "src", gemma4_config(), gemma4_state())
    parser = argparse.ArgumentParser(prog="dspark-hf")
    from dspark_hf.checkpoints.commands import add_convert_parser

    add_convert_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "deepspec"])
    assert args.func(args) == 0
    assert "deepspec-gemma4" in capsys.readouterr().out
    assert ck.detect_format(tmp_path / "out") == "deepspec-gemma4"

    drafter = DSparkDraftModel.from_pretrained(tmp_path / "out")
    info = ck.ModelCardInfo(base_model="google/gemma-4-12B-it", repo_id="me/dspark-gemma4",
                            tau={"gsm8k": {"T=0": 6.05, "T=1": 5.9}, "mt-bench": {"T=0": 3.49}},
                            calibration={"ECE after STS": "1.1 %"}, training_data=["open-perfectblend"],
                            training_budget="10 epochs on 8xH100")
    card = ck.write_model_card(drafter, tmp_path / "out", info, layout="deepspec").read_text()
    assert card.startswith("---\nlibrary_name: dspark-hf") and "base_model: google/gemma-4-12B-it" in card
    assert "| gsm8k | 6.05 | 5.90 |" in card and "open-perfectblend" in card and "10 epochs on 8xH100" in card
    assert 'from_pretrained("me/dspark-gemma4")' in card and "DSPARK" in card and "ECE after STS" in card


def test_package_import_registers_the_resolver():
    assert dspark_hf.DSparkDraftModel.checkpoint_resolver is not None
