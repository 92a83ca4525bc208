"""The DeepSeek-V4 DSpark drafter (the `mtp.*` heads shipped inside DeepSeek-V4-{Flash,Pro}-DSpark checkpoints).

Built from transformers' own DeepSeek-V4 modules (`transformers.models.deepseek_v4`): each draft stage is a
`DeepseekV4DecoderLayer` (manifold-constrained hyper-connections `attn_hc`/`ffn_hc` over `hc_mult` residual streams,
`DeepseekV4SparseMoeBlock` with top-k routing and a shared expert, `input_layernorm`/`post_attention_layernorm`),
with `DeepseekV4Attention`'s projections (low-rank q `q_a_proj`→`q_a_norm`→`q_b_proj`→unweighted `q_b_norm`;
shared K=V `kv_proj`→`kv_norm`; per-head attention sinks; grouped output projection `o_a_proj`/`o_b_proj`; partial
interleaved RoPE with the conjugate rotation undone on the output) and V4's "main" (sliding-window) rope. The final
stage's streams collapse through `DeepseekV4HyperHead`, then the final `norm` and the target's LM head.

Sources and assumptions (see docs/formats.md):

- [3P, DeepSpec reference §14.1] three MoE stages with mHC and sliding-window attention 128; target taps = mean over
  the hyper-connection streams of the residual after each of `dspark_target_layer_ids`; `main_proj` + `main_norm`
  (= DeepSpec `fc` + `hidden_norm`); Markov head `embed`/`head` (= `markov_w1`/`markov_w2`); bias-less confidence head
  over `[h; markov_w1[prev]]`; embedding and LM head are the target's.
- [assumed, as in every DeepSpec drafter] KV injection: the projected context `main_norm(main_proj(taps))` goes
  straight through each stage's `kv_proj`/`kv_norm` (no hyper-connection, no `input_layernorm`), roped at its own
  positions; queries are the block tokens (`[anchor, noise × (γ-1)]`, hc-expanded embeddings) at positions
  `anchor..anchor+γ-1`; the block attends to the last `sliding_window` context positions before the anchor and
  bidirectionally to itself. Only context K/V are cached.
- [assumed] draft stages use V4's "main" rope (θ = `rope_theta`, the sliding-window layers' rope) and top-k ("moe")
  routing, not hash routing (hash routing keys on the layer's input ids, which a mask-filled block doesn't have).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers import DeepseekV4Config
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4DecoderLayer,
    DeepseekV4Experts,
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
    DeepseekV4TopKRouter,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .configuration import DSparkConfig
from .modeling import BACKBONE_MODELS, DSparkDraftModel

RotaryPair = tuple[torch.Tensor, torch.Tensor]


def deepseek_v4_config(config: DSparkConfig) -> DeepseekV4Config:
    """transformers' `DeepseekV4Config` for the draft stages: sliding-window attention and top-k MoE in every stage."""
    fields = {k: v for k, v in config.backbone_config.items() if k not in ("compress_ratios", "num_hash_layers")}
    n = config.num_hidden_layers
    fields.update(num_hidden_layers=n, layer_types=["sliding_attention"] * n, mlp_layer_types=["moe"] * n)
    v4 = DeepseekV4Config(**fields)
    v4._attn_implementation = "eager"  # V4 attention has sinks: eager only (as transformers' own V4)
    v4._experts_implementation = "eager"
    return v4


class DSparkDeepseekV4Attention(DeepseekV4Attention):
    """V4 sliding-window attention (sinks, shared K=V, grouped output) with the projected target context injected."""

    def __init__(self, config: DeepseekV4Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False

    def _kv(self, states: torch.Tensor, rotary: RotaryPair) -> torch.Tensor:
        kv = self.kv_norm(self.kv_proj(states)).view(*states.shape[:-1], 1, self.head_dim).transpose(1, 2)
        return apply_rotary_pos_emb(kv, *rotary)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: RotaryPair,
        context: torch.Tensor,
        context_rotary: RotaryPair,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        input_shape = hidden_states.shape[:-1]
        cos, sin = position_embeddings
        query = self.q_b_proj(self.q_a_norm(self.q_a_proj(hidden_states)))
        query = self.q_b_norm(query.view(*input_shape, -1, self.head_dim).transpose(1, 2))
        query = apply_rotary_pos_emb(query, cos, sin)
        context_kv = self._kv(context, context_rotary)
        if past_key_values is not None:
            context_kv = past_key_values.update(context_kv, context_kv, self.layer_idx)[0]
        if self.sliding_window:
            context_kv = context_kv[:, :, -self.sliding_window :]
        kv = torch.cat([context_kv, self._kv(hidden_states, position_embeddings)], dim=2)
        if attention_mask is not None and attention_mask.shape[-1] != kv.shape[2]:
            attention_mask = attention_mask[..., -kv.shape[2] :]  # training masks cover the whole context
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, _ = attention_interface(
            self, query, kv, kv, attention_mask, scaling=self.scaling,
            dropout=0.0 if not self.training else self.attention_dropout, s_aux=self.sinks,
        )
        # K = V carried RoPE on its rope slice: undo it at the query positions (as transformers' V4 attention does).
        output = apply_rotary_pos_emb(output.transpose(1, 2), cos, -sin).transpose(1, 2)
        grouped = self.o_a_proj(output.reshape(*input_shape, self.config.o_groups, -1)).flatten(2)
        return self.o_b_proj(grouped), None


class DSparkDeepseekV4DecoderLayer(DeepseekV4DecoderLayer):
    """transformers' V4 decoder layer (mHC + MoE) whose attention reads the injected context."""

    def __init__(self, config: DeepseekV4Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = DSparkDeepseekV4Attention(config, layer_idx)


class DeepseekV4DSparkDraftModel(DSparkDraftModel):
    """`DSparkDraftModel` over DeepSeek-V4 stages; `DSparkDraftModel(config)` builds it when `backbone="deepseek_v4"`.

    Reads target features as `[B, C, K·H]` or, straight from a V4 target's decoder layers, `[B, C, hc_mult, K·H]`
    (then averaged over the streams).
    """

    _no_split_modules = ["DSparkDeepseekV4DecoderLayer"]

    def _build_backbone(self, config: DSparkConfig) -> None:
        v4 = deepseek_v4_config(config)
        if v4.hidden_size != config.hidden_size or v4.vocab_size != config.vocab_size:
            raise ValueError("DSparkConfig.hidden_size/vocab_size must mirror backbone_config for a V4 drafter.")
        self.v4_config = v4
        hidden, eps = config.hidden_size, v4.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        self.layers = nn.ModuleList(DSparkDeepseekV4DecoderLayer(v4, i) for i in range(config.num_hidden_layers))
        self.hc_head = DeepseekV4HyperHead(v4)
        self.norm = DeepseekV4RMSNorm(hidden, eps=eps)
        self.hidden_norm = DeepseekV4RMSNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.rotary_emb = DeepseekV4RotaryEmbedding(v4)

    @torch.no_grad()
    def _init_weights(self, module):
        # As transformers' DeepseekV4PreTrainedModel: V4's own parameters and the rope buffers; `init.*` leaves
        # weights loaded from a checkpoint alone.
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, DeepseekV4TopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, DeepseekV4Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, DeepseekV4Attention):
            init.zeros_(module.sinks)
        elif isinstance(module, DeepseekV4HyperConnection):
            init.normal_(module.fn, mean=0.0, std=std)
            init.zeros_(module.base)
            init.ones_(module.scale)
        elif isinstance(module, DeepseekV4HyperHead):
            init.normal_(module.hc_fn, mean=0.0, std=std)
            init.zeros_(module.hc_base)
            init.ones_(module.hc_scale)
        elif isinstance(module, DeepseekV4RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DeepseekV4RotaryEmbedding):
            for layer_type in module.layer_types:
                inv_freq, _ = module.compute_default_rope_parameters(module.config, layer_type=layer_type)
                init.copy_(getattr(module, f"{layer_type}_inv_freq"), inv_freq)
                init.copy_(getattr(module, f"{layer_type}_original_inv_freq"), inv_freq)

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
        """Same contract as `DSparkDraftModel.forward`; returns `norm(hc_head(streams))` [B, Q, H]."""
        self.require_target_weights()
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        hidden_states = inputs_embeds.to(self.fc.weight.dtype)
        batch, block_len = hidden_states.shape[:2]
        if target_hidden_states is None:
            target_hidden_states = hidden_states.new_zeros(batch, 0, self.fc.in_features)
        if target_hidden_states.dim() == 4:  # [B, C, hc_mult, K·H] from a V4 target: mean over the streams
            target_hidden_states = target_hidden_states.mean(dim=2)
        context = self.hidden_norm(self.fc(target_hidden_states.to(hidden_states.dtype)))
        context_len = context.shape[1]
        if context_position_ids is None or position_ids is None:
            cached = past_key_values.get_seq_length() if past_key_values is not None else 0
            offsets = torch.arange(context_len + block_len, device=hidden_states.device) + cached
            if context_position_ids is None:
                context_position_ids = offsets[:context_len].expand(batch, -1)
            if position_ids is None:
                position_ids = offsets[context_len:].expand(batch, -1)
        rotary = self.rotary_emb(hidden_states, position_ids, layer_type="main")
        context_rotary = self.rotary_emb(hidden_states, context_position_ids, layer_type="main")
        streams = hidden_states.unsqueeze(2).expand(-1, -1, self.v4_config.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(
                streams,
                input_ids=input_ids,
                position_embeddings=rotary,
                context=context,
                context_rotary=context_rotary,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
            )
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(self.hc_head(streams)), past_key_values=past_key_values
        )


BACKBONE_MODELS["deepseek_v4"] = DeepseekV4DSparkDraftModel
