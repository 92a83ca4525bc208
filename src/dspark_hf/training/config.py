"""`TrainingConfig` (one flat dataclass, JSON-serialisable), presets, and the drafter config built from a target.

Presets reproduce DeepSpec's published recipes (`qwen3-{4b,8b,14b}-{dspark,dflash}`, `gemma4-12b-{dspark,dflash}`)
and add small ones for the offline code fixtures (`code50m-dspark`, `code50m-dflash`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from ..models import DSparkConfig, check_layer_ids
from .features import default_target_layer_ids
from .losses import LossWeights


@dataclass
class TrainingConfig:
    # --- what to train
    mode: str = "dspark"  # "dspark" (Markov + confidence heads, CE+TV+BCE) or "dflash" (CE only)
    block_size: int = 7
    num_draft_layers: int = 5
    target_layer_ids: list[int] | None = None  # None: DFlash's evenly spaced rule
    mask_token_id: int | None = None  # None: the tokenizer's mask token, else its last unused special token
    intermediate_size: int | None = None  # None: the target's
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head_with_markov: bool = True
    # --- losses
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0
    loss_decay_gamma: float = 4.0
    # --- data
    max_length: int = 4096
    num_anchors: int = 512
    # --- optimisation
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    batch_size: int = 512  # global batch, in sequences
    micro_batch_size: int = 1  # per process and forward
    num_epochs: float = 10.0
    max_steps: int | None = None
    seed: int = 42
    # --- runtime
    precision: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU), "bf16", "fp32"
    attn_implementation: str = "auto"  # "auto" (flex_attention on GPU, sdpa on CPU), "flex_attention", "sdpa", "eager"
    compile: bool = False
    distributed: str = "ddp"  # "ddp" or "fsdp" (used under `accelerate launch`)
    feature_cache: str | None = None  # folder of a `FeatureCache` (reused when complete)
    # --- logging / checkpoints / evaluation
    logging_steps: int = 10
    save_steps: int | None = None  # None: only at the end
    eval_steps: int | None = None  # real τ with target.generate(assistant_model=drafter); None: only at the end
    eval_max_new_tokens: int = 64
    eval_num_prompts: int = 8
    save_dtype: str = "bfloat16"  # dtype of the final exported drafter (checkpoints keep float32 for exact resume)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in ("dspark", "dflash"):
            raise ValueError(f"mode must be 'dspark' or 'dflash', got {self.mode!r}.")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of micro_batch_size {self.micro_batch_size}.")
        self.adam_betas = tuple(self.adam_betas)
        if self.mode == "dflash":
            self.markov_rank, self.confidence_alpha, self.l1_alpha = 0, 0.0, 0.0
            if self.ce_alpha == 0.1:
                self.ce_alpha = 1.0

    @property
    def loss_weights(self) -> LossWeights:
        return LossWeights(ce=self.ce_alpha, l1=self.l1_alpha, confidence=self.confidence_alpha,
                           decay_gamma=self.loss_decay_gamma)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> TrainingConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"Unknown training config fields: {unknown}. Known: {sorted(names)}.")
        return cls(**data)

    @classmethod
    def from_json(cls, path: str) -> TrainingConfig:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def replace(self, **changes) -> TrainingConfig:
        return TrainingConfig.from_dict({**self.to_dict(), **changes})


_DEEPSPEC = dict(block_size=7, num_draft_layers=5, num_anchors=512, max_length=4096, learning_rate=6e-4,
                 warmup_ratio=0.04, weight_decay=0.0, batch_size=512, micro_batch_size=1, num_epochs=10.0,
                 max_grad_norm=1.0, markov_rank=256, markov_head_type="vanilla", loss_decay_gamma=4.0, seed=42,
                 compile=True, logging_steps=10, save_steps=3000)
_DFLASH = dict(mode="dflash", markov_rank=0, ce_alpha=1.0, l1_alpha=0.0, confidence_alpha=0.0)
_TARGETS = {
    "qwen3-4b": dict(target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669),
    "qwen3-8b": dict(target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669),
    "qwen3-14b": dict(target_layer_ids=[1, 10, 19, 28, 37], mask_token_id=151669),
    "gemma4-12b": dict(target_layer_ids=[5, 17, 29, 41, 46], mask_token_id=4, compile=False),
}
# The 50M code fixture (8 layers, d=512): a small drafter (2 layers, FFN 768, Markov rank 32: ~16 MB in bf16
# without the shared embedding/LM head), reading layers 1, 3, 5 (never the last, 7).
_CODE50M = dict(block_size=7, num_draft_layers=2, intermediate_size=768, target_layer_ids=[1, 3, 5],
                mask_token_id=3, markov_rank=32, num_anchors=256, max_length=1024, learning_rate=1e-3,
                warmup_ratio=0.04, batch_size=16, micro_batch_size=8, num_epochs=1.0, logging_steps=25,
                eval_max_new_tokens=96, eval_num_prompts=8)

PRESETS: dict[str, dict] = {}
for _name, _target in _TARGETS.items():
    PRESETS[f"{_name}-dspark"] = {**_DEEPSPEC, **_target}
    PRESETS[f"{_name}-dflash"] = {**_DEEPSPEC, **_target, **_DFLASH}
PRESETS["code50m-dspark"] = dict(_CODE50M)
PRESETS["code50m-dflash"] = {**_CODE50M, **_DFLASH}


def preset(name: str, **overrides) -> TrainingConfig:
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}.")
    return TrainingConfig.from_dict({**PRESETS[name], **overrides})


# ---------------------------------------------------------------------------------------------- drafter config
def pick_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The tokenizer's mask token, else its highest-id special token that is not bos/eos/pad/unk."""
    if tokenizer is not None and tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    if tokenizer is not None:
        reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
        added = [i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i not in reserved and i < vocab_size]
        if added:
            return max(added)
    return vocab_size - 1


def build_drafter_config(target_config, config: TrainingConfig, tokenizer=None) -> DSparkConfig:
    """A `DSparkConfig` sized for the target (hidden size, vocab, norms, RoPE) with the training config's drafter."""
    text = target_config.get_text_config()
    layer_ids = config.target_layer_ids or default_target_layer_ids(text.num_hidden_layers, config.num_draft_layers)
    check_layer_ids(layer_ids, text.num_hidden_layers)
    heads = config.num_attention_heads or text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    mask_token_id = config.mask_token_id
    if mask_token_id is None:
        mask_token_id = pick_mask_token_id(tokenizer, text.vocab_size)
    dspark = config.mode == "dspark"
    return DSparkConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=config.intermediate_size or text.intermediate_size,
        num_hidden_layers=config.num_draft_layers,
        num_attention_heads=heads,
        num_key_value_heads=config.num_key_value_heads or getattr(text, "num_key_value_heads", None) or heads,
        head_dim=config.head_dim or getattr(text, "head_dim", None) or text.hidden_size // heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(text, "max_position_embeddings", 32768),
        rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
        tie_word_embeddings=False,
        pad_token_id=getattr(text, "pad_token_id", None),
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        block_size=config.block_size,
        target_layer_ids=list(layer_ids),
        num_target_layers=text.num_hidden_layers,
        mask_token_id=mask_token_id,
        num_anchors=config.num_anchors,
        markov_rank=config.markov_rank if dspark else 0,
        markov_head_type=config.markov_head_type,
        enable_confidence_head=dspark and config.confidence_alpha > 0,
        confidence_head_with_markov=config.confidence_head_with_markov,
        architectures=["DSparkDraftModel"],
    )
