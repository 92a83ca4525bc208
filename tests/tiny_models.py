"""Tiny random-init targets and drafters shared by the tests (built in code, no network)."""

from __future__ import annotations

import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.gemma4 import Gemma4ForCausalLM
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

from dspark_hf import DSparkConfig, DSparkDraftModel

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, TARGET_LAYERS = 32, 4, 2, 8, 4
COMMON = dict(
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=TARGET_LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
)
FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "gemma": (GemmaConfig, GemmaForCausalLM),
}


def tiny_target(family: str = "qwen3", vocab_size: int = 96, seed: int = 0, eos_token_id: int | None = 2,
                **overrides) -> PreTrainedModel:
    """A float32 random-init causal LM of the given family in eval mode."""
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_class(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=None, bos_token_id=None,
                          **{**COMMON, **overrides})
    return model_class(config).eval()


def tiny_gemma4_target(vocab_size: int = 96, hidden_size: int = 32) -> PreTrainedModel:
    """A float32 random-init Gemma4 text model with sliding-window and full-attention layers (K = V, soft-capping)."""
    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
        attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=8, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        eos_token_id=1, pad_token_id=0, bos_token_id=None,
    )
    return Gemma4ForCausalLM(config).eval()


def tiny_drafter(target: PreTrainedModel, block_size: int = 4, markov_rank: int = 8, head_type: str = "vanilla",
                 seed: int = 1, confidence: bool = True, target_layer_ids=(0, 2), **overrides) -> DSparkDraftModel:
    """A random-init drafter sized for `target` (its hidden size, vocab and layer count)."""
    text = target.config.get_text_config()
    torch.manual_seed(seed)
    config = DSparkConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=overrides.pop("head_dim", HEAD_DIM),
        target_layer_ids=list(target_layer_ids),
        num_target_layers=text.num_hidden_layers,
        mask_token_id=3,
        block_size=block_size,
        markov_rank=markov_rank,
        markov_head_type=head_type,
        enable_confidence_head=confidence,
        **overrides,
    )
    return DSparkDraftModel(config).eval()


OUTPUT_PROJECTIONS = ("o_proj.weight", "o_b_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


def make_bigram_like(target: PreTrainedModel, damping: float = 0.05) -> PreTrainedModel:
    """Shrinks every decoder layer's attention and MLP output projections (dense, MoE experts, DeepSeek-V4's grouped
    `o_b_proj`, linear attention's `out_proj`) so the target's next token depends mostly on the current one."""
    with torch.no_grad():
        for name, parameter in target.named_parameters():
            if ".layers." in name and name.endswith(OUTPUT_PROJECTIONS):
                parameter.mul_(damping)
    return target


def install_bigram_oracle(drafter: DSparkDraftModel, target: PreTrainedModel, scale: float = 30.0) -> DSparkDraftModel:
    """Sets a full-rank vanilla Markov head to the target's one-token greedy table (a good drafter).

    Requires `markov_rank == vocab_size`. Slot i then proposes argmax target(x_{i-1}) with high probability, so the
    acceptance paths (full accept, bonus token, eos inside a draft) get exercised.
    """
    vocab = drafter.config.vocab_size
    assert drafter.markov_head is not None and drafter.config.markov_rank == vocab
    with torch.no_grad():
        logits = target(torch.arange(vocab)[:, None]).logits[:, -1]
        table = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        drafter.markov_head.markov_w2.weight.copy_(scale * table.T)
    return drafter


def char_tokenizer():
    """A 96-token character tokenizer matching `tiny_target`'s default vocab: <pad> <s> </s> <mask>, then
    digits, letters, space, newline and 28 punctuation marks."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(string.digits + string.ascii_letters + " \n" + string.punctuation[:28])
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<mask>"] + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   mask_token="<mask>")
