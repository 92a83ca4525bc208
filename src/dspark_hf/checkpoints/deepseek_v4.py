"""DeepSeek-V4 DSpark heads: read the `mtp.{i}.*` tensors out of a V4 checkpoint into a `DSparkDraftModel`.

Names are DeepSeek's reference names (the published V4 layout); the per-stage renames are those transformers itself
applies to V4 decoder layers (`transformers.conversion_mapping`, "deepseek_v4"), and the DSpark-specific ones follow
the DeepSpec reference §14.1:

    mtp.0.main_proj.weight -> fc.weight                 mtp.0.main_norm.weight -> hidden_norm.weight
    mtp.L.norm.weight      -> norm.weight               mtp.L.hc_head_{fn,base,scale} -> hc_head.hc_{fn,base,scale}
    mtp.L.markov_head.embed.weight -> markov_head.markov_w1.weight
    mtp.L.markov_head.head.weight  -> markov_head.markov_w2.weight
    mtp.L.confidence_head.proj.weight -> confidence_head.proj.weight   (no bias in V4: bias := 0)
    mtp.i.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink} -> layers.i.self_attn.{q_a_proj,q_a_norm,q_b_proj,
        kv_proj,kv_norm,o_a_proj,o_b_proj,sinks}
    mtp.i.{attn_norm,ffn_norm} -> layers.i.{input_layernorm,post_attention_layernorm}
    mtp.i.hc_{attn,ffn}_{fn,base,scale} -> layers.i.{attn_hc,ffn_hc}.{fn,base,scale}
    mtp.i.ffn.gate.{weight,bias} -> layers.i.mlp.gate.{weight,e_score_correction_bias}
    mtp.i.ffn.shared_experts.w{1,2,3} -> layers.i.mlp.shared_experts.{gate,down,up}_proj
    mtp.i.ffn.experts.E.w{1,3} -> layers.i.mlp.experts.gate_up_proj[E] (w1 rows first), w2 -> ...down_proj[E]

(L = the last stage.) FP8 weights (`float8_e4m3fn` with a `<name>.scale` block scale, `weight_block_size` from
`quantization_config`) are dequantized on load; FP4 experts are refused with a clear error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..models import DSparkConfig, DSparkDraftModel
from .formats import HUB_KWARGS, _text_config

V4_DRAFT_DEFAULT_LAYERS = 3  # [PAPER §5.1] three MoE stages; SGLang's dspark_num_layers default
_STAGE_RENAMES = [
    (r"attn\.wq_a\.", "self_attn.q_a_proj."),
    (r"attn\.q_norm\.", "self_attn.q_a_norm."),
    (r"attn\.wq_b\.", "self_attn.q_b_proj."),
    (r"attn\.wkv\.", "self_attn.kv_proj."),
    (r"attn\.kv_norm\.", "self_attn.kv_norm."),
    (r"attn\.wo_a\.", "self_attn.o_a_proj."),
    (r"attn\.wo_b\.", "self_attn.o_b_proj."),
    (r"attn\.attn_sink$", "self_attn.sinks"),
    (r"attn_norm\.", "input_layernorm."),
    (r"ffn_norm\.", "post_attention_layernorm."),
    (r"hc_attn_(fn|base|scale)$", r"attn_hc.\1"),
    (r"hc_ffn_(fn|base|scale)$", r"ffn_hc.\1"),
    (r"ffn\.gate\.weight$", "mlp.gate.weight"),
    (r"ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"ffn\.shared_experts\.w1\.", "mlp.shared_experts.gate_proj."),
    (r"ffn\.shared_experts\.w2\.", "mlp.shared_experts.down_proj."),
    (r"ffn\.shared_experts\.w3\.", "mlp.shared_experts.up_proj."),
]
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.w([123])\.weight$")


def _weight_files(name_or_path, hub_kwargs: dict) -> list[str]:
    path = Path(name_or_path)
    from transformers.utils import cached_file

    def fetch(filename: str) -> str | None:
        if path.is_dir():
            file = path / hub_kwargs.get("subfolder", "") / filename
            return str(file) if file.is_file() else None
        return cached_file(str(name_or_path), filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)

    index = fetch("model.safetensors.index.json")
    if index:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        shards = sorted({shard for key, shard in weight_map.items() if key.startswith("mtp.")})
        if not shards:
            raise ValueError(f"{str(name_or_path)!r}: its safetensors index lists no mtp.* tensors (no DSpark heads).")
        return [fetch(shard) for shard in shards]
    single = fetch("model.safetensors")
    if single is None:
        raise ValueError(f"{str(name_or_path)!r} has no model.safetensors or model.safetensors.index.json.")
    return [single]


def read_mtp_tensors(name_or_path, **hub_kwargs) -> dict[str, torch.Tensor]:
    """Every `mtp.*` tensor of a V4 checkpoint (only those: the target's weights are never read)."""
    tensors = {}
    for file in _weight_files(name_or_path, hub_kwargs):
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                if key.startswith("mtp."):
                    tensors[key] = handle.get_tensor(key)
    return tensors


def _dequantize(tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """FP8 block-quantized weights (`x.weight` float8 + `x.scale`) -> float32; FP4 (packed int8) refused."""
    out = {}
    for key, tensor in tensors.items():
        if key.endswith(".scale") and key[: -len(".scale")] + ".weight" in tensors:
            continue
        scale = tensors.get(key[: -len(".weight")] + ".scale") if key.endswith(".weight") else None
        if scale is not None:
            if tensor.dtype in (torch.int8, torch.uint8) or "float4" in str(tensor.dtype):
                raise ValueError(
                    f"{key} is FP4-packed ({tensor.dtype}); dspark_hf dequantizes FP8 block weights only. Convert the "
                    "V4 checkpoint's experts to bf16 first."
                )
            rows, cols = tensor.shape
            full = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
            tensor = tensor.float() * full
        out[key] = tensor
    return out


def remap_mtp_keys(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Reference `mtp.*` names -> `DeepseekV4DSparkDraftModel` state-dict names (raises on names it doesn't know)."""
    last = num_layers - 1
    out, experts, unknown = {}, {}, []
    singles = {
        "mtp.0.main_proj.weight": "fc.weight",
        "mtp.0.main_norm.weight": "hidden_norm.weight",
        f"mtp.{last}.norm.weight": "norm.weight",
        f"mtp.{last}.hc_head_fn": "hc_head.hc_fn",
        f"mtp.{last}.hc_head_base": "hc_head.hc_base",
        f"mtp.{last}.hc_head_scale": "hc_head.hc_scale",
        f"mtp.{last}.markov_head.embed.weight": "markov_head.markov_w1.weight",
        f"mtp.{last}.markov_head.head.weight": "markov_head.markov_w2.weight",
        f"mtp.{last}.confidence_head.proj.weight": "confidence_head.proj.weight",
        f"mtp.{last}.confidence_head.proj.bias": "confidence_head.proj.bias",
    }
    for key, tensor in tensors.items():
        if key in singles:
            out[singles[key]] = tensor
            continue
        match = re.match(r"mtp\.(\d+)\.(.+)$", key)
        if match is None or int(match.group(1)) >= num_layers:
            unknown.append(key)
            continue
        stage, rest = int(match.group(1)), match.group(2)
        expert = _EXPERT.match(rest)
        if expert:
            experts.setdefault(stage, {}).setdefault(int(expert.group(1)), {})[expert.group(2)] = tensor
            continue
        for pattern, replacement in _STAGE_RENAMES:
            if re.match(pattern, rest):
                out[f"layers.{stage}." + re.sub(pattern, replacement, rest, count=1)] = tensor
                break
        else:
            unknown.append(key)
    for stage, by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))) or any(set(by_expert[e]) != {"1", "2", "3"} for e in ids):
            raise ValueError(f"mtp.{stage}.ffn.experts: incomplete expert weights (need w1, w2, w3 for 0..E-1).")
        out[f"layers.{stage}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["1"], by_expert[e]["3"]], dim=0) for e in ids]
        )
        out[f"layers.{stage}.mlp.experts.down_proj"] = torch.stack([by_expert[e]["2"] for e in ids])
    if unknown:
        raise ValueError(f"DeepSeek-V4 DSpark checkpoint: mtp tensors dspark_hf cannot place: {sorted(unknown)[:12]}")
    return out


def count_stages(keys) -> int:
    stages = {int(m.group(1)) for key in keys if (m := re.match(r"mtp\.(\d+)\.", key))}
    return max(stages) + 1 if stages else 0


def v4_dspark_config(config: dict, num_layers: int | None = None, has_confidence_bias: bool = False) -> DSparkConfig:
    """A V4 config.json with `dspark_*` keys -> `DSparkConfig(backbone="deepseek_v4")` for its draft stages."""
    text = _text_config(config)
    n = num_layers or text.get("dspark_num_layers") or V4_DRAFT_DEFAULT_LAYERS
    backbone = {
        k: v for k, v in text.items()
        if not k.startswith("dspark_") and k not in (
            "architectures", "model_type", "transformers_version", "auto_map", "dtype", "torch_dtype",
            "quantization_config", "expert_dtype", "text_config", "layer_types", "mlp_layer_types", "compress_ratios",
            "num_hash_layers",
        )
    }
    for ours, theirs in (("n_routed_experts", "dspark_n_routed_experts"),
                         ("num_experts_per_tok", "dspark_num_experts_per_tok"),
                         ("moe_intermediate_size", "dspark_moe_intermediate_size")):
        if theirs in text:
            backbone[ours] = text[theirs]
    rank = int(text.get("dspark_markov_rank", 0))
    if "dspark_noise_token_id" not in text or "dspark_target_layer_ids" not in text:
        raise ValueError("A DeepSeek-V4 DSpark config needs dspark_noise_token_id and dspark_target_layer_ids.")
    drafter = DSparkConfig(
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        num_hidden_layers=n,
        num_attention_heads=text.get("num_attention_heads", 64),
        num_key_value_heads=text.get("num_attention_heads", 64),
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        block_size=text.get("dspark_block_size", 5),
        target_layer_ids=list(text["dspark_target_layer_ids"]),
        num_target_layers=text["num_hidden_layers"],
        mask_token_id=text["dspark_noise_token_id"],
        markov_rank=rank,
        markov_head_type="vanilla" if rank else None,
        enable_confidence_head=True,
        confidence_head_with_markov=rank > 0,
        backbone="deepseek_v4",
        backbone_config=backbone,
        tie_word_embeddings=False,
        architectures=["DSparkDraftModel"],
        eos_token_id=text.get("eos_token_id"),
        bos_token_id=text.get("bos_token_id"),
    )
    drafter.dtype = text.get("dtype") or text.get("torch_dtype")
    return drafter


def load_deepseek_v4_dspark(name_or_path, config: dict, **kwargs) -> DSparkDraftModel:
    """Builds the V4 DSpark drafter of a V4 checkpoint (config dict already read) and loads its `mtp.*` weights."""
    hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    raw = read_mtp_tensors(name_or_path, **hub_kwargs)
    block = tuple((_text_config(config).get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    raw = _dequantize(raw, block)
    num_layers = _text_config(config).get("dspark_num_layers") or count_stages(raw)
    drafter_config = v4_dspark_config(config, num_layers)
    state = remap_mtp_keys(raw, num_layers)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype in (None, "auto"):
        dtype = drafter_config.dtype or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = DSparkDraftModel(drafter_config)
    expected = model.state_dict()
    if "confidence_head.proj.bias" in expected and "confidence_head.proj.bias" not in state:
        state["confidence_head.proj.bias"] = torch.zeros_like(expected["confidence_head.proj.bias"])
    shareable = {"embed_tokens.weight", "lm_head.weight"}
    missing = sorted(set(expected) - set(state) - shareable)
    unexpected = sorted(set(state) - set(expected))
    mismatched = sorted(k for k in state if k in expected and tuple(state[k].shape) != tuple(expected[k].shape))
    if missing or unexpected or mismatched:
        raise ValueError(
            f"The DeepSeek-V4 DSpark heads in {str(name_or_path)!r} do not match their config ({num_layers} stages, "
            f"markov_rank={drafter_config.markov_rank}): missing {missing[:12]}, unexpected {unexpected[:12]}, "
            f"wrong shape {mismatched[:12]}."
        )
    model.load_state_dict(state, strict=False)
    model.to(dtype)  # the hyper-connection maths runs in float32 inside transformers' modules whatever the dtype
    model.weights_from_target = {"embed_tokens", "lm_head"} - {k.split(".")[0] for k in state}
    return model.eval()
