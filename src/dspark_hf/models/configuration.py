"""`DSparkConfig`: the drafter's configuration (a Qwen3-family backbone plus the DSpark fields).

A DeepSpec checkpoint's `config.json` (`architectures: ["Qwen3DSparkModel"]`, `model_type: "qwen3"`) is a deep
copy of the target's config plus the DSpark fields, so it parses into this class as it is: no conversion step.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config

# Checkpoint layouts this class reads directly (`architectures[0]` in config.json).
# (save_pretrained writes the class name: the per-backbone subclasses of DSparkDraftModel are native too)
NATIVE_ARCHITECTURES = ("DSparkDraftModel", "Gemma4DSparkDraftModel", "DeepseekV4DSparkDraftModel")
DEEPSPEC_ARCHITECTURES = ("Qwen3DSparkModel",)
KNOWN_ARCHITECTURES = NATIVE_ARCHITECTURES + DEEPSPEC_ARCHITECTURES
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# Backbone families (`DSparkConfig.backbone`): one module per family under `dspark_hf.models`.
BACKBONES = ("qwen3", "gemma4", "deepseek_v4")
# How a block maps to drafts (`DSparkConfig.block_layout`): DeepSpec's anchor-as-first-prediction (γ inputs, γ drafts,
# slot i predicts position anchor + i + 1) or z-lab DFlash's (γ inputs, γ-1 drafts, mask slot j predicts anchor + j).
BLOCK_LAYOUTS = ("deepspec", "zlab")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's rule: evenly spaced decoder layers from 1 to N-3 (one draft layer: the middle layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@strict
class DSparkConfig(Qwen3Config):
    r"""Configuration of a DSpark (or, with `markov_rank=0` and no confidence head, DFlash) drafter.

    Backbone fields are Qwen3's. DSpark fields:

    - `block_size` (γ): the drafter reads `[anchor, mask × (γ-1)]` and drafts γ tokens; slot i predicts position
      `anchor + i + 1`.
    - `target_layer_ids`: 0-based decoder layers of the target whose outputs are concatenated as the context
      features (`-1` = the embedding output). Never the target's last layer (HF returns it post-norm).
    - `num_target_layers`: number of decoder layers of the target the drafter was trained for.
    - `mask_token_id`: id of the mask token filling the γ-1 slots after the anchor.
    - `markov_rank` / `markov_head_type`: the low-rank Markov head (`vanilla`, `gated`, `rnn`); rank 0 disables it.
    - `enable_confidence_head` / `confidence_head_with_markov`: the per-slot acceptance predictor.
    - `sts_temperatures`: per-slot temperatures from Sequential Temperature Scaling (None = uncalibrated).
    - `num_anchors`: anchors sampled per training sequence.
    - `backbone`: the layer family (`qwen3`, `gemma4`, `deepseek_v4`). For non-Qwen3 families, `backbone_config` holds
      that family's own transformers config fields (Gemma4TextConfig / DeepseekV4Config kwargs); the top-level sizes
      (`hidden_size`, `vocab_size`, `num_hidden_layers`, `rms_norm_eps`) mirror it.
    - `block_layout`: `deepspec` (γ drafts; slot i predicts anchor + i + 1) or `zlab` (z-lab DFlash: γ-1 drafts; mask
      slot j predicts anchor + j).
    """

    model_type = "dspark"

    block_size: int = 7
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    mask_token_id: int | None = None
    num_anchors: int = 512
    markov_rank: int = 256
    markov_head_type: str | None = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    sts_temperatures: list[float] | None = None
    backbone: str = "qwen3"
    backbone_config: dict | None = None
    block_layout: str = "deepspec"

    def __post_init__(self, **kwargs):
        architectures = self.architectures or kwargs.get("architectures") or []
        if architectures and architectures[0] not in KNOWN_ARCHITECTURES:
            raise ValueError(
                f"Unknown drafter checkpoint format {architectures[0]!r}. DSparkConfig reads: "
                f"{', '.join(KNOWN_ARCHITECTURES)} (native and DeepSpec Qwen3 DSpark/DFlash)."
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}.")
        if self.markov_rank > 0:
            self.markov_head_type = (self.markov_head_type or "vanilla").lower()
            if self.markov_head_type not in MARKOV_HEAD_TYPES:
                raise ValueError(
                    f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}."
                )
        if self.sts_temperatures is not None and len(self.sts_temperatures) != self.block_size:
            raise ValueError(
                f"sts_temperatures has {len(self.sts_temperatures)} entries, expected block_size={self.block_size}."
            )
        if self.backbone not in BACKBONES:
            raise ValueError(f"backbone must be one of {BACKBONES}, got {self.backbone!r}.")
        if self.backbone != "qwen3" and not self.backbone_config:
            raise ValueError(f"backbone={self.backbone!r} needs backbone_config (that family's config fields).")
        if self.block_layout not in BLOCK_LAYOUTS:
            raise ValueError(f"block_layout must be one of {BLOCK_LAYOUTS}, got {self.block_layout!r}.")
        if self.block_layout == "zlab" and self.block_size < 2:
            raise ValueError("A z-lab (DFlash) block needs block_size >= 2: the anchor slot drafts nothing.")
        # DeepSpec drafters attend to all context and the whole block: no sliding window.
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        super().__post_init__(**kwargs)

    @classmethod
    def from_target_config(
        cls,
        target_config,
        mask_token_id: int,
        num_hidden_layers: int = 5,
        target_layer_ids: list[int] | None = None,
        **overrides,
    ) -> DSparkConfig:
        """A drafter config for a target, as DeepSpec's `build_draft_config`: the target's text backbone sizes plus
        DSpark fields. Default layers: `num_hidden_layers` taps evenly spaced from 1 to N-3 (DFlash's rule)."""
        text = target_config.get_text_config()
        num_target_layers = text.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_hidden_layers)
        backbone = {
            key: getattr(text, key)
            for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "hidden_act")
            if getattr(text, key, None) is not None
        }
        backbone["head_dim"] = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        backbone["rope_parameters"] = dict(getattr(text, "rope_parameters", None) or {"rope_type": "default",
                                                                                       "rope_theta": 10000.0})
        return cls(
            **{**backbone, **overrides},
            num_hidden_layers=num_hidden_layers,
            target_layer_ids=list(target_layer_ids),
            num_target_layers=num_target_layers,
            mask_token_id=mask_token_id,
        )

    @property
    def is_dflash(self) -> bool:
        """True for a plain DFlash drafter (no Markov head, no confidence head)."""
        return self.markov_rank == 0 and not self.enable_confidence_head

    @property
    def num_draft_slots(self) -> int:
        """Drafts one block yields: `block_size` (DeepSpec layout) or `block_size - 1` (z-lab layout)."""
        return self.block_size - (1 if self.block_layout == "zlab" else 0)

    @property
    def confidence_input_size(self) -> int:
        uses_markov = self.confidence_head_with_markov and self.markov_rank > 0
        return self.hidden_size + (self.markov_rank if uses_markov else 0)
