"""Checkpoint formats: detection, conversion to our layout, export to DeepSpec / z-lab layouts, model cards.

Importing this package registers `resolve_checkpoint` as `DSparkDraftModel.checkpoint_resolver`, so that
`DSparkDraftModel.from_pretrained` reads every format in `FORMATS` (models never import this package).
"""

from __future__ import annotations

from ..models import DSparkDraftModel
from .card import ModelCardInfo, model_card, push_to_hub, write_model_card
from .convert import TARGET_LAYOUTS, convert, export_deepspec, export_zlab, save_as
from .deepseek_v4 import load_deepseek_v4_dspark, remap_mtp_keys, v4_dspark_config
from .formats import FORMATS, HUB_KWARGS, detect_format, read_config_dict, to_dspark_config


def resolve_checkpoint(name_or_path, kwargs: dict):
    """`DSparkDraftModel.checkpoint_resolver`: None (load as usual), a translated config, or a loaded drafter."""
    hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    try:
        config = read_config_dict(name_or_path, **hub_kwargs)
    except (OSError, ValueError):
        return None  # from_pretrained reports the missing / unreadable checkpoint itself
    fmt = detect_format(config)
    if fmt == "deepseek-v4-dspark":
        return load_deepseek_v4_dspark(name_or_path, config, **kwargs)
    return to_dspark_config(config, fmt)


DSparkDraftModel.checkpoint_resolver = staticmethod(resolve_checkpoint)

__all__ = [
    "FORMATS",
    "TARGET_LAYOUTS",
    "ModelCardInfo",
    "convert",
    "detect_format",
    "export_deepspec",
    "export_zlab",
    "load_deepseek_v4_dspark",
    "model_card",
    "push_to_hub",
    "read_config_dict",
    "remap_mtp_keys",
    "resolve_checkpoint",
    "save_as",
    "to_dspark_config",
    "v4_dspark_config",
    "write_model_card",
]
