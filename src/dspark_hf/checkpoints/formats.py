"""Checkpoint formats: detect one from its `config.json` and translate its config into a `DSparkConfig`.

| format | config.json | weights |
|---|---|---|
| `native` | `model_type "dspark"`, `architectures ["DSparkDraftModel"]` | ours |
| `deepspec-qwen3` | `architectures ["Qwen3DSparkModel"]`, `model_type "qwen3"` | ours (DeepSpec's un-prefixed keys) |
| `deepspec-gemma4` | `architectures ["Gemma4DSparkModel"]`, `model_type "gemma4_text"` | ours (+ `layer_scalar`, no `v_proj`) |
| `zlab-dflash` | `architectures ["DFlashDraftModel"]`, nested `dflash_config` | ours minus embed/lm_head |
| `deepseek-v4-dspark` | `DeepseekV4ForCausalLM` config with `dspark_*` keys | `mtp.{i}.*` inside the V4 checkpoint |

DeepSpec DSpark and DFlash share a class; DFlash has `markov_rank 0` and `enable_confidence_head false`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..models import DSparkConfig

FORMATS = {
    "native": "dspark_hf native (architectures DSparkDraftModel, model_type dspark)",
    "deepspec-qwen3": "DeepSpec Qwen3DSparkModel (DSpark or DFlash; deepseek-ai/d{spark,flash}_qwen3_*_block7)",
    "deepspec-gemma4": "DeepSpec Gemma4DSparkModel (DSpark or DFlash; deepseek-ai/d{spark,flash}_gemma4_12b_block7)",
    "zlab-dflash": "z-lab DFlashDraftModel (z-lab/*-DFlash-b16)",
    "deepseek-v4-dspark": "DeepSeek-V4 DSpark heads (mtp.* inside a DeepseekV4ForCausalLM checkpoint with dspark_* keys)",
}

# DSpark fields (DeepSpec names) shared by every DeepSpec-layout config.
DSPARK_FIELDS = (
    "block_size", "target_layer_ids", "num_target_layers", "mask_token_id", "num_anchors", "markov_rank",
    "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "sts_temperatures",
)
# Keys of a config.json that describe the file, not the model.
META_FIELDS = ("architectures", "model_type", "transformers_version", "auto_map", "dtype", "torch_dtype", "_name_or_path")
HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "subfolder", "force_download", "proxies")


def known_formats_message() -> str:
    return "; ".join(f"{name}: {text}" for name, text in FORMATS.items())


def read_config_dict(name_or_path: str | os.PathLike, **hub_kwargs) -> dict:
    """config.json of a local folder or a Hub repo, as a dict."""
    path = Path(name_or_path)
    if path.is_dir():
        file = path / hub_kwargs.get("subfolder", "") / "config.json"
        if not file.is_file():
            raise ValueError(f"{str(name_or_path)!r} has no config.json; a drafter checkpoint needs one.")
    else:
        from transformers.utils import cached_file

        file = cached_file(str(name_or_path), "config.json", **hub_kwargs)
    try:
        return json.loads(Path(file).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"config.json of {str(name_or_path)!r} is not valid JSON: {error}") from error


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def detect_format(config: dict | str | os.PathLike) -> str:
    """The format name (a key of `FORMATS`) of a config.json (dict) or of a checkpoint folder / Hub id."""
    if not isinstance(config, dict):
        config = read_config_dict(config)
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if "speculators_config" in config:
        problem = "a RedHatAI speculators checkpoint (speculators_config), which dspark_hf does not read"
    elif config.get("model_type") == "dspark" or arch == "DSparkDraftModel":
        return "native"
    elif arch == "Qwen3DSparkModel":
        return "deepspec-qwen3"
    elif arch == "Gemma4DSparkModel":
        return "deepspec-gemma4"
    elif arch == "DFlashDraftModel" or "dflash_config" in config:
        return "zlab-dflash"
    elif arch == "DeepseekV4ForCausalLM" or _text_config(config).get("model_type") == "deepseek_v4":
        if any(key.startswith("dspark_") for key in _text_config(config)):
            return "deepseek-v4-dspark"
        problem = "a DeepSeek-V4 checkpoint without DSpark heads (no dspark_* keys in its config)"
    elif arch and "Eagle3" in arch:
        problem = f"an Eagle3 drafter ({arch}), not a DSpark/DFlash block drafter"
    else:
        problem = f"architectures={architectures!r}, model_type={config.get('model_type')!r}"
    raise ValueError(f"Unknown drafter checkpoint format: {problem}. dspark_hf reads: {known_formats_message()}.")


def _dtype_of(config: dict):
    return config.get("dtype") or config.get("torch_dtype")


def _dspark_fields(config: dict) -> dict:
    return {key: config[key] for key in DSPARK_FIELDS if key in config}


def gemma4_config(config: dict) -> DSparkConfig:
    """DeepSpec `Gemma4DSparkModel` config.json -> `DSparkConfig(backbone="gemma4")`."""
    backbone = {k: v for k, v in config.items() if k not in DSPARK_FIELDS and k not in META_FIELDS}
    dspark = _dspark_fields(config)
    dspark.setdefault("markov_rank", 0)
    dspark.setdefault("enable_confidence_head", False)
    mirror = {k: backbone[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "rms_norm_eps", "pad_token_id", "bos_token_id",
                                       "eos_token_id", "max_position_embeddings") if k in backbone}
    drafter = DSparkConfig(
        **mirror, **dspark, backbone="gemma4", backbone_config=backbone, tie_word_embeddings=False,
        architectures=["DSparkDraftModel"],
    )
    drafter.dtype = _dtype_of(config)
    return drafter


def zlab_config(config: dict) -> DSparkConfig:
    """z-lab `DFlashDraftModel` config.json -> `DSparkConfig(block_layout="zlab")` (no heads, no embed/LM head)."""
    nested = config.get("dflash_config") or {}
    if "target_layer_ids" not in nested or "mask_token_id" not in nested:
        raise ValueError("A z-lab DFlash config needs dflash_config.target_layer_ids and dflash_config.mask_token_id.")
    fields = {k: v for k, v in config.items() if k not in META_FIELDS and k != "dflash_config"}
    fields.update(
        target_layer_ids=list(nested["target_layer_ids"]),
        mask_token_id=nested["mask_token_id"],
        markov_rank=0,
        markov_head_type=None,
        enable_confidence_head=False,
        block_layout="zlab",
        architectures=["DSparkDraftModel"],
    )
    drafter = DSparkConfig(**fields)
    drafter.dtype = _dtype_of(config)
    return drafter


def to_dspark_config(config: dict, fmt: str | None = None) -> DSparkConfig | None:
    """The `DSparkConfig` of a config.json in format `fmt` (detected when None). None for `native` and
    `deepspec-qwen3`, which `DSparkConfig` reads as they are. V4 configs need the weights: see `deepseek_v4.py`."""
    fmt = fmt or detect_format(config)
    if fmt in ("native", "deepspec-qwen3"):
        return None
    if fmt == "deepspec-gemma4":
        return gemma4_config(config)
    if fmt == "zlab-dflash":
        return zlab_config(config)
    raise ValueError(f"Format {fmt!r} is translated together with its weights (dspark_hf.checkpoints.deepseek_v4).")
