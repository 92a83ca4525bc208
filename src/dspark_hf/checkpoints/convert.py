"""Conversion between layouts: load any known format, write ours (`native`), DeepSpec's (`deepspec`, what vLLM and
SGLang serve as `Qwen3DSparkModel` / `Gemma4DSparkModel`) or z-lab's (`zlab`, `DFlashDraftModel`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from ..models import DSparkDraftModel
from .formats import DSPARK_FIELDS

TARGET_LAYOUTS = ("native", "deepspec", "zlab")
_OUR_FIELDS = ("backbone", "backbone_config", "block_layout")


def _dtype_name(model: torch.nn.Module) -> str:
    return str(model.dtype).removeprefix("torch.")


def _write(folder: Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {key: tensor.detach().to("cpu").contiguous().clone() for key, tensor in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _full_state(drafter: DSparkDraftModel, layout: str) -> dict[str, torch.Tensor]:
    if drafter.weights_from_target:
        raise ValueError(
            f"The {layout} layout stores the embedding and LM head, but this drafter takes "
            f"{sorted(drafter.weights_from_target)} from its target: call drafter.share_target_weights(target) first "
            "(CLI: --target <target model>)."
        )
    return drafter.state_dict()


def _dspark_dict(config) -> dict:
    fields = {key: getattr(config, key) for key in DSPARK_FIELDS}
    if config.sts_temperatures is None:
        fields.pop("sts_temperatures")
    if config.markov_rank == 0:  # DeepSpec's DFlash configs carry neither key
        fields.pop("markov_head_type")
    if not config.enable_confidence_head:
        fields.pop("confidence_head_with_markov")
    return fields


def export_deepspec(drafter: DSparkDraftModel, save_directory: str | os.PathLike) -> Path:
    """Writes the DeepSpec layout (config.json + model.safetensors with un-prefixed keys incl. embed/LM head) that
    vLLM and SGLang serve (`Qwen3DSparkModel` / `Gemma4DSparkModel`)."""
    config = drafter.config
    if config.block_layout != "deepspec":
        raise ValueError("A z-lab-layout (DFlash b16) drafter has no DeepSpec equivalent: export it with to='zlab'.")
    if config.backbone == "qwen3":
        out = {k: v for k, v in config.to_dict().items() if k not in _OUR_FIELDS and k not in DSPARK_FIELDS}
        out.update(architectures=["Qwen3DSparkModel"], model_type="qwen3")
    elif config.backbone == "gemma4":
        out = dict(config.backbone_config)
        out.update(architectures=["Gemma4DSparkModel"], model_type="gemma4_text",
                   num_hidden_layers=config.num_hidden_layers, vocab_size=config.vocab_size,
                   hidden_size=config.hidden_size)
    else:
        raise ValueError(
            f"backbone {config.backbone!r} has no standalone DeepSpec layout: DeepSeek-V4 DSpark heads ship inside the "
            "V4 checkpoint, and vLLM/SGLang serve them from there."
        )
    out.update(_dspark_dict(config), dtype=_dtype_name(drafter), tie_word_embeddings=False)
    out.pop("_name_or_path", None)
    path = Path(save_directory)
    _write(path, out, _full_state(drafter, "DeepSpec"))
    return path


def export_zlab(drafter: DSparkDraftModel, save_directory: str | os.PathLike) -> Path:
    """Writes z-lab's `DFlashDraftModel` layout (no embedding / LM head; nested `dflash_config`)."""
    config = drafter.config
    if config.backbone != "qwen3" or config.block_layout != "zlab":
        raise ValueError("Only z-lab-layout Qwen3 drafters (block_layout='zlab') export to the z-lab layout.")
    out = {k: v for k, v in config.to_dict().items() if k not in _OUR_FIELDS and k not in DSPARK_FIELDS}
    out.update(
        architectures=["DFlashDraftModel"], model_type="qwen3", block_size=config.block_size,
        num_target_layers=config.num_target_layers, dtype=_dtype_name(drafter),
        dflash_config={"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
    )
    out.pop("_name_or_path", None)
    state = {k: v for k, v in drafter.state_dict().items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    path = Path(save_directory)
    _write(path, out, state)
    return path


def save_as(drafter: DSparkDraftModel, save_directory, to: str = "native") -> Path:
    """Saves `drafter` in layout `to` (one of `TARGET_LAYOUTS`)."""
    if to == "native":
        drafter.save_pretrained(save_directory)
        return Path(save_directory)
    if to == "deepspec":
        return export_deepspec(drafter, save_directory)
    if to == "zlab":
        return export_zlab(drafter, save_directory)
    raise ValueError(f"Unknown output layout {to!r}; choose one of {TARGET_LAYOUTS}.")


def convert(src, dst, to: str = "native", target: PreTrainedModel | str | None = None, **load_kwargs) -> Path:
    """Loads the drafter at `src` (any format `detect_format` knows) and writes it to `dst` in layout `to`.

    `target` (a model or a path/Hub id of one): supplies the embedding / LM head for sources without them (z-lab,
    DeepSeek-V4) when the output layout stores them (`deepspec`).
    """
    if to not in TARGET_LAYOUTS:
        raise ValueError(f"Unknown output layout {to!r}; choose one of {TARGET_LAYOUTS}.")
    drafter = DSparkDraftModel.from_pretrained(src, **load_kwargs)
    if target is not None:
        if not isinstance(target, PreTrainedModel):
            from transformers import AutoModelForCausalLM

            target = AutoModelForCausalLM.from_pretrained(target, dtype=drafter.dtype)
        drafter.share_target_weights(target)
    return save_as(drafter, dst, to)
