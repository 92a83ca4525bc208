"""The Qwen3-family DSpark backbone: a Qwen3 decoder layer whose attention also reads injected context K/V.

"KV injection" (DeepSpec `Qwen3DSparkAttention`): queries come from the block tokens only; keys and values are
`[k_proj(ctx); k_proj(x)]` and `[v_proj(ctx); v_proj(x)]`, where ctx = `hidden_norm(fc(target features))` is the
same tensor for every layer and is *not* passed through `input_layernorm`. Attention is non-causal: the block sees
all the context and its whole self. Only the context K/V go into the drafter cache; block K/V are never cached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .configuration import DSparkConfig

RotaryPair = tuple[torch.Tensor, torch.Tensor]


def attend_with_injected_context(
    module: nn.Module,
    query: torch.Tensor,
    context_kv: tuple[torch.Tensor, torch.Tensor],
    block_kv: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None,
) -> torch.Tensor:
    """The KV-injection core shared by the backbones: append the new context K/V to the cache (context only), attend
    from the block queries [B, heads, Q, hd] to all cached context plus the whole block, non-causally. Returns the
    attention output [B, Q, heads, hd]."""
    context_keys, context_values = context_kv
    if past_key_values is not None:
        context_keys, context_values = past_key_values.update(context_keys, context_values, module.layer_idx)
    keys = torch.cat([context_keys, block_kv[0]], dim=2)
    values = torch.cat([context_values, block_kv[1]], dim=2)
    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        module.config._attn_implementation, eager_attention_forward
    )
    output, _ = attention_interface(
        module,
        query,
        keys,
        values,
        attention_mask,
        dropout=module.attention_dropout if module.training else 0.0,
        scaling=module.scaling,
        is_causal=False,
    )
    return output


def _rotate(states: torch.Tensor, rotary: RotaryPair) -> torch.Tensor:
    """Applies RoPE to [B, heads, T, hd] states (`apply_rotary_pos_emb` rotates q and k; we use one side)."""
    cos, sin = rotary
    return apply_rotary_pos_emb(states, states, cos, sin)[0]


class DSparkAttention(nn.Module):
    """Qwen3 attention with the target context injected as extra keys/values."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        hidden, heads, kv_heads, bias = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.attention_bias,
        )
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _keys_values(self, states: torch.Tensor, rotary: RotaryPair) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*states.shape[:-1], self.config.num_key_value_heads, self.head_dim)
        keys = self.k_norm(self.k_proj(states).view(shape)).transpose(1, 2)
        values = self.v_proj(states).view(shape).transpose(1, 2)
        return _rotate(keys, rotary), values

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        rotary: RotaryPair,
        context_rotary: RotaryPair,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
    ) -> torch.Tensor:
        """`hidden_states` [B, Q, H] block, `context` [B, C, H] new projected context (C may be 0).

        With a cache, the new context K/V are appended to it and the block attends to everything cached.
        """
        input_shape = hidden_states.shape[:-1]
        query = self.q_proj(hidden_states).view(*input_shape, self.config.num_attention_heads, self.head_dim)
        query = self.q_norm(query).transpose(1, 2)
        query = _rotate(query, rotary)
        output = attend_with_injected_context(
            self,
            query,
            self._keys_values(context, context_rotary),
            self._keys_values(hidden_states, rotary),
            attention_mask,
            past_key_values,
        )
        return self.o_proj(output.reshape(*input_shape, -1).contiguous())


class DSparkDecoderLayer(nn.Module):
    """Pre-norm Qwen3 block; only the block tokens go through `input_layernorm`, never the context."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DSparkAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        rotary: RotaryPair,
        context_rotary: RotaryPair,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), context, rotary, context_rotary, attention_mask, past_key_values
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
