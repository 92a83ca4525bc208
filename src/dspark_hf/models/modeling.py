"""`DSparkDraftModel`: the DSpark / DFlash block drafter as a `PreTrainedModel`.

State-dict keys equal DeepSpec's un-prefixed keys (`embed_tokens.weight`, `layers.N.…`, `fc.weight`,
`hidden_norm.weight`, `norm.weight`, `lm_head.weight`, `markov_head.markov_w{1,2}.weight`,
`confidence_head.proj.{weight,bias}`), so `deepseek-ai/dspark_qwen3_*_block7` checkpoints load as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from ..tensor_ops import argmax_last
from . import placement
from .configuration import DSparkConfig
from .heads import ConfidenceHead, MarkovHead
from .qwen3 import DSparkDecoderLayer

# Weights the drafter may take from its target instead of storing its own copy.
SHAREABLE_WEIGHTS = {"embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}
logger = logging.getLogger(__name__)


class _HeldLoadReport(logging.Filter):
    """Holds transformers' load report (a warning) while a drafter loads. A drafter that takes `embed_tokens` /
    `lm_head` from its target lacks them on purpose, and the report would call them "MISSING ... newly initialized";
    `release()` logs it after all (when the checkpoint turns out to be wrong)."""

    def __init__(self, model_class: type, source):
        super().__init__()
        self.logger = logging.getLogger("transformers.modeling_utils")  # the logger transformers reports on
        self.marks = (f"{model_class.__name__} LOAD REPORT", f"from: {source}")  # this load's report, no other's
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if all(mark in message for mark in self.marks):
            self.held.append(record)
            return False
        return True

    def __enter__(self) -> _HeldLoadReport:
        self.logger.addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeFilter(self)

    def release(self) -> None:
        for record in self.held:
            self.logger.handle(record)

# `DSparkConfig.backbone` -> the `DSparkDraftModel` subclass that builds that family's layers (registered by
# `models/gemma4.py`, `models/deepseek_v4.py`). "qwen3" is `DSparkDraftModel` itself.
BACKBONE_MODELS: dict[str, type] = {}

# `select(drafted_so_far [B, i], logits [B, V] float32) -> (tokens [B], processed logits [B, V] float32)`:
# picks slot i's token and returns the exact logits it was drawn from (softmax of them = q).
TokenSelector = Callable[[torch.LongTensor, torch.Tensor], tuple[torch.LongTensor, torch.Tensor]]


def greedy_selector(drafted: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
    """Default selector: argmax of the raw logits."""
    return argmax_last(logits), logits


@dataclass
class DraftProposal:
    """One round of drafting for a batch of requests.

    `tokens` [B, k]: drafted tokens. `logits` [B, k, V] float32: the processed logits each token was drawn from.
    `confidence_logits` [B, k] float32 or None: raw (uncalibrated) confidence-head logits, slot k conditional
    on slots < k having been accepted.
    """

    tokens: torch.LongTensor
    logits: torch.Tensor
    confidence_logits: torch.Tensor | None = None


class DSparkPreTrainedModel(PreTrainedModel):
    config_class = DSparkConfig
    config: DSparkConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["DSparkDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True


class DSparkDraftModel(DSparkPreTrainedModel):
    """The DSpark drafter: a few Qwen3-style layers over `[anchor, mask × (γ-1)]` with the target's features injected.

    Use it as `target.generate(**inputs, assistant_model=drafter)` after `import dspark_hf`.
    """

    # Set by `dspark_hf.generation.hook.install()`: None once generate() routes DSpark drafters, else the reason.
    hook_unavailable_reason: str | None = "dspark_hf's generate() hook is not installed (import dspark_hf)."
    # Set by `dspark_hf.checkpoints` on import (models never import checkpoints): `(name_or_path, kwargs) -> None`
    # (native / DeepSpec-Qwen3 layout: load as usual), a `DSparkConfig` (another layout whose weight names are ours)
    # or a loaded drafter (a layout it had to remap); raises a ValueError naming the known formats otherwise.
    checkpoint_resolver: ClassVar[Callable | None] = None

    def __new__(cls, config: DSparkConfig, *args, **kwargs):
        # `DSparkDraftModel(config)` builds the subclass of `config.backbone` (Gemma4, DeepSeek-V4, ...).
        if cls is DSparkDraftModel and getattr(config, "backbone", "qwen3") != "qwen3":
            if config.backbone not in BACKBONE_MODELS:
                raise ValueError(f"No drafter class registered for backbone {config.backbone!r}.")
            cls = BACKBONE_MODELS[config.backbone]
        return super().__new__(cls)

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        if not config.target_layer_ids:
            raise ValueError("DSparkConfig.target_layer_ids must list the target layers the drafter reads.")
        if config.mask_token_id is None:
            raise ValueError("DSparkConfig.mask_token_id must be set (the token filling the block after the anchor).")
        hidden = config.hidden_size
        self._build_backbone(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.markov_head = MarkovHead(config) if config.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None
        # Weights absent from the loaded checkpoint, to be taken from the target (see `share_target_weights`).
        self.weights_from_target: set[str] = set()
        # Weights that are the target's own Parameters (after `share_target_weights`).
        self.shared_with_target: set[str] = set()
        self.generation_config = GenerationConfig()  # DSpark defaults only; sampling settings come from the target
        self.post_init()

    def _build_backbone(self, config: DSparkConfig) -> None:
        """Family-specific modules: `embed_tokens`, `layers`, `norm`, `hidden_norm`, `lm_head`, `rotary_emb`."""
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        self.layers = nn.ModuleList(DSparkDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs) -> DSparkDraftModel:
        """Loads a native or DeepSpec (`Qwen3DSparkModel`) checkpoint; safetensors only.

        Missing or unexpected weights raise `ValueError`, except `embed_tokens.weight` / `lm_head.weight`, which may
        be absent: they are then taken from the target when generation starts.
        """
        if kwargs.get("use_safetensors") is False:
            raise ValueError("dspark_hf loads safetensors checkpoints only (no pickle).")
        if DSparkDraftModel.checkpoint_resolver is not None and kwargs.get("config") is None:
            resolved = DSparkDraftModel.checkpoint_resolver(pretrained_model_name_or_path, kwargs)
            if isinstance(resolved, DSparkDraftModel):
                return (resolved, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}) if kwargs.get(
                    "output_loading_info") else resolved
            if resolved is not None:
                kwargs["config"] = resolved
        kwargs["use_safetensors"] = True
        want_info = kwargs.pop("output_loading_info", False)
        kwargs.setdefault("ignore_mismatched_sizes", True)  # collect shape mismatches and report them all below
        report = _HeldLoadReport(cls, pretrained_model_name_or_path)
        try:
            with report:
                model, info = super().from_pretrained(
                    pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
                )
        except (OSError, RuntimeError, SafetensorError) as error:
            report.release()
            raise ValueError(
                f"Could not load a DSpark drafter from {pretrained_model_name_or_path!r}: {error}\n"
                "dspark_hf needs config.json plus model.safetensors (or a sharded safetensors index). If the files "
                "exist, they may be truncated or corrupt: download them again."
            ) from error
        missing = set(info["missing_keys"])
        problems = []
        if missing - SHAREABLE_WEIGHTS.keys():
            problems.append(f"missing weights: {sorted(missing - SHAREABLE_WEIGHTS.keys())}")
        if info["unexpected_keys"]:
            problems.append(f"unexpected weights: {sorted(info['unexpected_keys'])}")
        if info.get("mismatched_keys"):
            problems.append(f"weights with the wrong shape: {sorted(info['mismatched_keys'])}")
        if problems:
            report.release()
            raise ValueError(
                f"The checkpoint at {pretrained_model_name_or_path!r} does not match its config "
                f"({model.config.num_hidden_layers} layers, markov_rank={model.config.markov_rank}, "
                f"confidence head={model.config.enable_confidence_head}): " + "; ".join(problems)
            )
        model.weights_from_target = {SHAREABLE_WEIGHTS[key] for key in missing}
        if model.weights_from_target:
            logger.info("%s: %s not in the checkpoint; taken from the target when generation starts.",
                        pretrained_model_name_or_path, sorted(model.weights_from_target))
        hub_kwargs = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder") if k in kwargs}
        try:  # the drafter's DSpark generation defaults (dspark_policy, ...), when the checkpoint has them
            model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        except OSError:
            pass
        return (model, info) if want_info else model

    def share_target_weights(self, target: PreTrainedModel) -> list[str]:
        """Uses the target's input embedding and LM head where ours are absent or identical; returns what was shared.

        Sharing means the drafter holds the target's `Parameter`, so no second vocab matrix stays in memory. A drafter
        still on the CPU first moves next to the target's LM head when that head runs on an accelerator (one you
        placed yourself stays put). Weights that are offloaded (accelerate `device_map`), on another device than the
        drafter, or quantized are used through views that compute where the weight lives (see `models/placement.py`).
        """
        return placement.share_target_weights(self, target)

    def require_target_weights(self) -> None:
        """Raises unless the weights this checkpoint left to the target have been shared from it."""
        if self.weights_from_target:
            raise ValueError(
                f"This drafter's {sorted(self.weights_from_target)} come from its target: call "
                "`drafter.share_target_weights(target)` first (generate() does it for you)."
            )

    def save_pretrained(self, save_directory, *args, include_target_weights: bool | None = None, **kwargs) -> None:
        """`PreTrainedModel.save_pretrained`, safetensors only.

        `include_target_weights`: whether to store `embed_tokens` / `lm_head`. Default: store them unless they are
        shared with a target (then the checkpoint stays small and loads its copies from the target at generation).
        DeepSpec's published checkpoints include them; pass True to write that layout.
        """
        if kwargs.get("safe_serialization") is False:
            raise ValueError("dspark_hf saves safetensors only.")
        state_dict = kwargs.pop("state_dict", None) or self.state_dict()
        dropped = set() if include_target_weights else set(self.shared_with_target) | self.weights_from_target
        if include_target_weights is False:
            dropped = set(SHAREABLE_WEIGHTS.values())
        if include_target_weights and self.weights_from_target:
            raise ValueError(f"{sorted(self.weights_from_target)} are not loaded; share them from a target first.")
        if include_target_weights:  # weights reached through views onto an offloaded / other-device target
            state_dict = {**state_dict, **placement.view_state_dict(self)}
        state_dict = {
            key: tensor.detach().clone() if key in SHAREABLE_WEIGHTS else tensor  # never alias the target's storage
            for key, tensor in state_dict.items()
            if SHAREABLE_WEIGHTS.get(key) not in dropped
        }
        super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)

    @classmethod
    def can_generate(cls) -> bool:
        """True so that transformers keeps, saves and loads a `generation_config` for the drafter: it carries the
        drafter's DSpark defaults (`dspark_policy`, `dspark_threshold`), read when it drafts for a target."""
        return True

    def generate(self, *args, **kwargs):
        """Not a standalone LM: reached only when transformers routes the drafter to its default assistant path."""
        raise RuntimeError(
            "A DSparkDraftModel drafts for a target: call target.generate(..., assistant_model=drafter). "
            f"{self.hook_unavailable_reason or ''}"
        )

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        target_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        context_position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Runs the backbone over block tokens with the target's features injected.

        `input_ids` [B, Q] block tokens (or `inputs_embeds`); `target_hidden_states` [B, C, K·H] raw target features
        of C new context positions (concatenated over `target_layer_ids`). Positions default to: context right after
        what the cache holds, block right after the context. `attention_mask` (optional, [B, 1, Q, C_total + Q]) is
        used for training-time block masks; inference attends to everything. Returns the final-normed block hidden
        states [B, Q, H].
        """
        self.require_target_weights()
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        hidden_states = inputs_embeds.to(self.compute_dtype)
        batch, block_len = hidden_states.shape[:2]
        if target_hidden_states is None:
            target_hidden_states = hidden_states.new_zeros(batch, 0, self.fc.in_features)
        context = self.hidden_norm(self.fc(target_hidden_states.to(hidden_states.dtype)))
        context_len = context.shape[1]
        if context_position_ids is None or position_ids is None:
            cached = past_key_values.get_seq_length() if past_key_values is not None else 0
            offsets = torch.arange(context_len + block_len, device=hidden_states.device) + cached
            context_position_ids = offsets[:context_len].expand(batch, -1) if context_position_ids is None else context_position_ids
            position_ids = offsets[context_len:].expand(batch, -1) if position_ids is None else position_ids
        rotary = self.rotary_emb(hidden_states, position_ids)
        context_rotary = self.rotary_emb(hidden_states, context_position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, rotary, context_rotary, attention_mask, past_key_values)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The drafter's activation dtype (its float weights' dtype, also when its linear layers are quantized)."""
        weight = self.fc.weight
        return weight.dtype if weight.is_floating_point() and weight.element_size() >= 2 else self.norm.weight.dtype

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """LM-head logits in float32 (the weight may be the target's, possibly of another dtype, device or format)."""
        head = self.lm_head
        if not isinstance(head, nn.Linear) or placement.is_quantized(head):
            return head(hidden_states).float()  # a view onto the target's head (`models/placement.py`)
        return nn.functional.linear(hidden_states.to(head.weight.dtype), head.weight).float()

    def confidence_logits(self, hidden_states: torch.Tensor, prev_ids: torch.LongTensor) -> torch.Tensor | None:
        """Raw confidence logits [..., γ] for slots with hidden states [..., γ, H] and predecessors [..., γ]."""
        if self.confidence_head is None:
            return None
        use_code = self.config.confidence_head_with_markov and self.markov_head is not None
        code = self.markov_head.markov_w1(prev_ids) if use_code else None
        return self.confidence_head(hidden_states, code).float()

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def draft(
        self,
        anchor_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor,
        past_key_values: Cache,
        position_ids: torch.LongTensor | None = None,
        context_position_ids: torch.LongTensor | None = None,
        num_tokens: int | None = None,
        select: TokenSelector = greedy_selector,
        attention_mask: torch.Tensor | None = None,
    ) -> DraftProposal:
        """Drafts up to `block_size` tokens after `anchor_ids` [B] in one backbone forward plus the Markov loop.

        The new context features are appended to `past_key_values` (context K/V only). Slot i's logits are the
        backbone logits plus the Markov bias of the token drafted at slot i-1 (the anchor for i = 0); `select` turns
        them into a token and the exact logits it was drawn from. `attention_mask` ([B, 1, γ, cached + γ], additive)
        hides cache rows that are not context, e.g. the unused tail of a static cache.
        """
        hidden, base_logits = self.draft_backbone(anchor_ids, target_hidden_states, past_key_values, position_ids,
                                                  context_position_ids, num_tokens, attention_mask)
        return self.draft_tokens(anchor_ids, hidden, base_logits, select)

    @torch.no_grad()
    def draft_backbone(
        self,
        anchor_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor,
        past_key_values: Cache,
        position_ids: torch.LongTensor | None = None,
        context_position_ids: torch.LongTensor | None = None,
        num_tokens: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first half of `draft()`: the one parallel forward over [anchor, mask slots] -> (the hidden states of
        the `num_tokens` drafting slots [B, n, H], their logits before the Markov bias [B, n, V])."""
        gamma = self.config.block_size
        slots = self.config.num_draft_slots  # z-lab layout: mask slot j (1..γ-1) drafts position anchor + j
        offset = gamma - slots
        num_tokens = slots if num_tokens is None else min(num_tokens, slots)
        block_ids = anchor_ids.new_full((anchor_ids.shape[0], gamma), self.config.mask_token_id)
        block_ids[:, 0] = anchor_ids
        hidden = self(
            input_ids=block_ids,
            target_hidden_states=target_hidden_states,
            position_ids=position_ids,
            context_position_ids=context_position_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
        ).last_hidden_state[:, offset: offset + num_tokens]
        return hidden, self.compute_logits(hidden)

    @torch.no_grad()
    def draft_tokens(self, anchor_ids: torch.LongTensor, hidden: torch.Tensor, base_logits: torch.Tensor,
                     select: TokenSelector = greedy_selector) -> DraftProposal:
        """The second half of `draft()`: the Markov loop over `draft_backbone`'s outputs, one token per slot."""
        tokens, step_logits = [], []
        prev = anchor_ids
        batch = anchor_ids.shape[0]
        state = self.markov_head.initial_state(batch, hidden) if self.markov_head is not None else None
        for slot in range(hidden.shape[1]):
            logits = base_logits[:, slot]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(prev, hidden[:, slot], state)
                logits = logits + bias.float()
            drafted = torch.stack(tokens, dim=1) if tokens else anchor_ids.new_empty(batch, 0)
            prev, processed = select(drafted, logits)
            tokens.append(prev)
            step_logits.append(processed)
        token_tensor = torch.stack(tokens, dim=1)
        prev_ids = torch.cat([anchor_ids[:, None], token_tensor[:, :-1]], dim=1)
        return DraftProposal(
            tokens=token_tensor,
            logits=torch.stack(step_logits, dim=1),
            confidence_logits=self.confidence_logits(hidden, prev_ids),
        )
