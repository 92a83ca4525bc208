"""The Gemma4-family DSpark backbone (DeepSpec `Gemma4DSparkModel`), built from transformers' own Gemma4 modules.

Reused as they are from `transformers.models.gemma4`: `Gemma4TextDecoderLayer` (sandwich norms
input/post_attention/pre_feedforward/post_feedforward, `Gemma4TextMLP`, the persistent `layer_scalar` buffer),
`Gemma4TextAttention`'s projections and norms (full-attention layers: `global_head_dim`, `num_global_key_value_heads`
KV heads, with `attention_k_eq_v` no `v_proj` — V is the raw `k_proj` output through the weightless `v_norm`;
scale 1.0), `Gemma4TextScaledWordEmbedding` (embed_scale = H**0.5), `Gemma4RMSNorm`, and `Gemma4TextRotaryEmbedding`
for the `full_attention` rope (proportional, partial 0.25). Only the attention's forward is ours: the KV injection
(queries from the block; keys/values = [context; block], context K/V cached, non-causal), exactly as in `qwen3.py`.
The final logit softcap (`final_logit_softcapping`, 30) is applied in `compute_logits`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextAttention,
    Gemma4TextDecoderLayer,
    Gemma4TextRotaryEmbedding,
    Gemma4TextScaledWordEmbedding,
    apply_rotary_pos_emb,
)

from .configuration import DSparkConfig
from .modeling import BACKBONE_MODELS, DSparkDraftModel
from .qwen3 import RotaryPair, attend_with_injected_context



def gemma4_text_config(config: DSparkConfig) -> Gemma4TextConfig:
    """transformers' `Gemma4TextConfig` for the drafter's layers (all `full_attention`, no PLE, no MoE)."""
    fields = dict(config.backbone_config)
    if fields.get("enable_moe_block") or fields.get("hidden_size_per_layer_input"):
        raise ValueError(
            "Gemma4 DSpark drafters have no MoE block and no per-layer inputs (DeepSpec asserts enable_moe_block=False "
            "and hidden_size_per_layer_input=0); this backbone_config asks for them."
        )
    fields.update(
        num_hidden_layers=config.num_hidden_layers,
        layer_types=["full_attention"] * config.num_hidden_layers,
        hidden_size_per_layer_input=0,
        enable_moe_block=False,
        num_kv_shared_layers=0,
    )
    text = Gemma4TextConfig(**fields)
    text._attn_implementation = config._attn_implementation
    return text


class DSparkGemma4Attention(Gemma4TextAttention):
    """Gemma4 full attention with the target context injected as extra keys/values (DeepSpec Gemma4DSparkAttention)."""

    def __init__(self, config: Gemma4TextConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False

    def _keys_values(self, states: torch.Tensor, rotary: RotaryPair) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*states.shape[:-1], -1, self.head_dim)
        keys = self.k_proj(states).view(shape)
        values = self.v_proj(states).view(shape) if self.v_proj is not None else keys
        keys = apply_rotary_pos_emb(self.k_norm(keys), *rotary, unsqueeze_dim=2).transpose(1, 2)
        return keys, self.v_norm(values).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: RotaryPair,
        attention_mask: torch.Tensor | None,
        shared_kv_states=None,
        past_key_values: Cache | None = None,
        context: torch.Tensor | None = None,
        context_rotary: RotaryPair | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        input_shape = hidden_states.shape[:-1]
        query = self.q_norm(self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim))
        query = apply_rotary_pos_emb(query, *position_embeddings, unsqueeze_dim=2).transpose(1, 2)
        output = attend_with_injected_context(
            self,
            query,
            self._keys_values(context, context_rotary),
            self._keys_values(hidden_states, position_embeddings),
            attention_mask,
            past_key_values,
        )
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), None


class DSparkGemma4DecoderLayer(Gemma4TextDecoderLayer):
    """transformers' Gemma4 decoder layer (sandwich norms, `layer_scalar`) with the KV-injection attention."""

    def __init__(self, config: Gemma4TextConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = DSparkGemma4Attention(config, layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        rotary: RotaryPair,
        context_rotary: RotaryPair,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
    ) -> torch.Tensor:
        # Same call contract as `qwen3.DSparkDecoderLayer`; the extra keywords reach the attention through the
        # Gemma4 layer's **kwargs. The context is never normed by `input_layernorm` (as in DeepSpec).
        return super().forward(
            hidden_states,
            shared_kv_states={},
            position_embeddings=rotary,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            context=context,
            context_rotary=context_rotary,
        )


class Gemma4FullAttentionRotary(nn.Module):
    """`Gemma4TextRotaryEmbedding` fixed to the `full_attention` rope (the drafter's only layer type)."""

    def __init__(self, config: Gemma4TextConfig):
        super().__init__()
        self.inner = Gemma4TextRotaryEmbedding(config)

    def forward(self, x: torch.Tensor, position_ids: torch.LongTensor) -> RotaryPair:
        return self.inner(x, position_ids, "full_attention")


class Gemma4DSparkDraftModel(DSparkDraftModel):
    """`DSparkDraftModel` over Gemma4 layers; build it with `DSparkDraftModel(config)` where `config.backbone="gemma4"`."""

    _no_split_modules = ["DSparkGemma4DecoderLayer"]

    def _build_backbone(self, config: DSparkConfig) -> None:
        text = gemma4_text_config(config)
        hidden, eps = config.hidden_size, text.rms_norm_eps
        if text.hidden_size != hidden or text.vocab_size != config.vocab_size:
            raise ValueError("DSparkConfig.hidden_size/vocab_size must mirror backbone_config for a gemma4 drafter.")
        self.embed_tokens = Gemma4TextScaledWordEmbedding(
            config.vocab_size, hidden, config.pad_token_id, embed_scale=hidden**0.5
        )
        self.layers = nn.ModuleList(DSparkGemma4DecoderLayer(text, i) for i in range(config.num_hidden_layers))
        self.norm = Gemma4RMSNorm(hidden, eps=eps)
        self.hidden_norm = Gemma4RMSNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.rotary_emb = Gemma4FullAttentionRotary(text)
        self.final_logit_softcapping = text.final_logit_softcapping

    def _init_weights(self, module):
        # Non-persistent buffers (rope tables, embed scale) are rebuilt here after a meta-device load, as
        # transformers' Gemma4PreTrainedModel does; `init.*` leaves weights loaded from the checkpoint alone.
        super()._init_weights(module)
        if isinstance(module, Gemma4TextDecoderLayer):
            init.ones_(module.layer_scalar)
        elif isinstance(module, Gemma4RMSNorm) and getattr(module, "with_scale", False):
            init.ones_(module.weight)
        elif isinstance(module, Gemma4TextScaledWordEmbedding):
            init.constant_(module.embed_scale, module.scalar_embed_scale)
        elif isinstance(module, Gemma4TextRotaryEmbedding):
            for layer_type, rope_init_fn in module.rope_init_fns.items():
                inv_freq, _ = rope_init_fn(module.config.per_layer_config[layer_type], layer_type=layer_type)
                init.copy_(getattr(module, f"{layer_type}_inv_freq"), inv_freq)
                init.copy_(getattr(module, f"{layer_type}_original_inv_freq"), inv_freq)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """LM-head logits in float32, soft-capped: `tanh(logits / cap) * cap` (`final_logit_softcapping`)."""
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


BACKBONE_MODELS["gemma4"] = Gemma4DSparkDraftModel
