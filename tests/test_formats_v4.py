"""DeepSeek-V4 DSpark heads (`mtp.{0,1,2}.*` inside a V4 checkpoint) at tiny size: load with the remap, block
logits equal the V4 block maths written out here, and the drafter drives a tiny transformers V4 target losslessly."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

import dspark_hf  # noqa: F401
import dspark_hf.checkpoints as ck
from dspark_hf import DSparkDraftModel

H, V, HEADS, HD, ROPE, QR, OG, OR, E, TOPK, INTER, HC = 32, 96, 4, 16, 8, 16, 2, 8, 4, 2, 16, 2
STAGES, TAPS, BLOCK, LIMIT, ITERS, EPS, SCALE = 3, [0, 1, 2], 5, 10.0, 3, 1e-6, 1.5
FP8_BLOCK = 16


def v4_config(window: int = 64) -> dict:
    """A `DeepseekV4ForCausalLM` config.json with the DSpark keys of V4-Flash-DSpark (reference §14.1), tiny."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": V, "hidden_size": H,
        "moe_intermediate_size": INTER, "num_hidden_layers": 4, "num_attention_heads": HEADS, "num_key_value_heads": 1,
        "head_dim": HD, "qk_rope_head_dim": ROPE, "q_lora_rank": QR, "o_groups": OG, "o_lora_rank": OR,
        "num_experts_per_tok": TOPK, "n_routed_experts": E, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": SCALE, "hc_mult": HC, "hc_sinkhorn_iters": ITERS, "hc_eps": EPS,
        "sliding_window": window, "swiglu_limit": LIMIT, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4, "num_hash_layers": 0,
        "compress_ratios": [0, 0, 0, 0, 0, 0, 0], "num_nextn_predict_layers": 1, "eos_token_id": 2, "bos_token_id": 0,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]},
        "dspark_block_size": BLOCK, "dspark_markov_rank": 8, "dspark_target_layer_ids": TAPS,
        "dspark_noise_token_id": 3,
    }


def mtp_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Reference-named `mtp.*` tensors (bf16; `main_proj` FP8 + block scale) plus a few of the target's own."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    mix = (2 + HC) * HC
    main = torch.randn(H, len(TAPS) * H, generator=generator) * 0.1
    scale = torch.rand(H // FP8_BLOCK, len(TAPS) * H // FP8_BLOCK, generator=generator) * 0.02 + 0.01
    state = {"embed.weight": rand(V, H), "head.weight": rand(V, H), "layers.0.attn_norm.weight": rand(H),
             "mtp.0.main_proj.weight": (main / scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
                                        ).to(torch.float8_e4m3fn),
             "mtp.0.main_proj.scale": scale, "mtp.0.main_norm.weight": 1 + rand(H)}
    for i in range(STAGES):
        p = f"mtp.{i}."
        state.update({
            p + "attn.wq_a.weight": rand(QR, H), p + "attn.q_norm.weight": 1 + rand(QR),
            p + "attn.wq_b.weight": rand(HEADS * HD, QR), p + "attn.wkv.weight": rand(HD, H),
            p + "attn.kv_norm.weight": 1 + rand(HD), p + "attn.wo_a.weight": rand(OG * OR, HEADS * HD // OG),
            p + "attn.wo_b.weight": rand(H, OG * OR), p + "attn.attn_sink": rand(HEADS),
            p + "attn_norm.weight": 1 + rand(H), p + "ffn_norm.weight": 1 + rand(H),
            p + "ffn.gate.weight": rand(E, H), p + "ffn.gate.bias": rand(E),
            p + "ffn.shared_experts.w1.weight": rand(INTER, H), p + "ffn.shared_experts.w2.weight": rand(H, INTER),
            p + "ffn.shared_experts.w3.weight": rand(INTER, H),
        })
        for site in ("attn", "ffn"):
            state.update({f"{p}hc_{site}_fn": rand(mix, HC * H), f"{p}hc_{site}_base": rand(mix),
                          f"{p}hc_{site}_scale": 1 + rand(3)})
        for e in range(E):
            state.update({f"{p}ffn.experts.{e}.w1.weight": rand(INTER, H), f"{p}ffn.experts.{e}.w2.weight": rand(H, INTER),
                          f"{p}ffn.experts.{e}.w3.weight": rand(INTER, H)})
    last = f"mtp.{STAGES - 1}."
    state.update({last + "norm.weight": 1 + rand(H), last + "hc_head_fn": rand(HC, HC * H), last + "hc_head_base": rand(HC),
                  last + "hc_head_scale": 1 + rand(1), last + "markov_head.embed.weight": rand(V, 8),
                  last + "markov_head.head.weight": rand(V, 8), last + "confidence_head.proj.weight": rand(1, H + 8)})
    return state


def write(folder, config, state):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------ the V4 DSpark block maths, written out
def rms(x, w=None, eps=1e-6):
    x = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return x if w is None else x * w


def rope_interleaved(x, pos, sign=1.0):
    """Rotates the trailing ROPE channels of x [T, heads, HD] pairwise (2i, 2i+1) by pos·θ_i."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2).float() / ROPE))
    ang = pos[:, None].float() * inv[None]
    cos, sin = ang.cos()[:, None], sign * ang.sin()[:, None]
    nope, rope = x[..., :-ROPE], x[..., -ROPE:]
    a, b = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([nope, rotated], -1)


def hyper(streams, fn, base, scale):
    """mHC mapping: (pre-collapsed input, post weights, doubly-stochastic comb) for streams [T, HC, H]."""
    mixes = rms(streams.flatten(1)) @ fn.T
    pre = torch.sigmoid(mixes[:, :HC] * scale[0] + base[:HC]) + EPS
    post = 2 * torch.sigmoid(mixes[:, HC:2 * HC] * scale[1] + base[HC:2 * HC])
    comb = torch.softmax(mixes[:, 2 * HC:].view(-1, HC, HC) * scale[2] + base[2 * HC:].view(HC, HC), -1) + EPS
    comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    for _ in range(ITERS - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    return (pre[..., None] * streams).sum(1), post, comb


def swiglu(x, w1, w2, w3):
    return (F.silu((x @ w1.T).clamp(max=LIMIT)) * (x @ w3.T).clamp(-LIMIT, LIMIT)) @ w2.T


def reference_hidden(s, ids, taps, context_pos, block_pos, window):
    """taps [C, HC, K·H] (target streams), ids [Q] -> final-normed block hidden [Q, H]."""
    ctx = rms(taps.mean(1) @ s["main_proj"].T, s["mtp.0.main_norm.weight"])
    x = s["embed.weight"][ids][:, None].expand(-1, HC, -1)
    for i in range(STAGES):
        p = f"mtp.{i}."
        collapsed, post, comb = hyper(x, s[p + "hc_attn_fn"], s[p + "hc_attn_base"], s[p + "hc_attn_scale"])
        h = rms(collapsed, s[p + "attn_norm.weight"])
        q = (rms(h @ s[p + "attn.wq_a.weight"].T, s[p + "attn.q_norm.weight"]) @ s[p + "attn.wq_b.weight"].T)
        q = rope_interleaved(rms(q.view(-1, HEADS, HD)), block_pos)
        kv_ctx = rope_interleaved(rms(ctx @ s[p + "attn.wkv.weight"].T, s[p + "attn.kv_norm.weight"])[:, None],
                                  context_pos)[-window:]
        kv_blk = rope_interleaved(rms(h @ s[p + "attn.wkv.weight"].T, s[p + "attn.kv_norm.weight"])[:, None], block_pos)
        kv = torch.cat([kv_ctx, kv_blk])[:, 0]
        scores = torch.einsum("qhd,kd->hqk", q, kv) * HD**-0.5
        sinks = s[p + "attn.attn_sink"][:, None, None].expand(-1, len(ids), 1)
        att = torch.softmax(torch.cat([scores, sinks], -1), -1)[..., :-1]
        out = rope_interleaved(torch.einsum("hqk,kd->qhd", att, kv), block_pos, sign=-1.0).reshape(len(ids), OG, -1)
        wo_a = s[p + "attn.wo_a.weight"].view(OG, OR, -1)
        out = torch.einsum("qgi,goi->qgo", out, wo_a).reshape(len(ids), -1) @ s[p + "attn.wo_b.weight"].T
        x = post[..., None] * out[:, None] + torch.einsum("tjk,tjd->tkd", comb, x)

        collapsed, post, comb = hyper(x, s[p + "hc_ffn_fn"], s[p + "hc_ffn_base"], s[p + "hc_ffn_scale"])
        h = rms(collapsed, s[p + "ffn_norm.weight"])
        scores = F.softplus(h @ s[p + "ffn.gate.weight"].T).sqrt()
        chosen = torch.topk(scores + s[p + "ffn.gate.bias"], TOPK, -1).indices
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(-1, keepdim=True) * SCALE
        routed = torch.zeros_like(h)
        for t in range(len(ids)):
            for slot in range(TOPK):
                e = int(chosen[t, slot])
                routed[t] += weights[t, slot] * swiglu(h[t], *(s[f"{p}ffn.experts.{e}.w{j}.weight"] for j in (1, 2, 3)))
        shared = swiglu(h, *(s[f"{p}ffn.shared_experts.w{j}.weight"] for j in (1, 2, 3)))
        x = post[..., None] * (routed + shared)[:, None] + torch.einsum("tjk,tjd->tkd", comb, x)
    last = f"mtp.{STAGES - 1}."
    pre = torch.sigmoid((rms(x.flatten(1)) @ s[last + "hc_head_fn"].T) * s[last + "hc_head_scale"]
                        + s[last + "hc_head_base"]) + EPS
    return rms((pre[..., None] * x).sum(1), s[last + "norm.weight"])


def test_v4_mtp_heads_load_and_match_reference_math(tmp_path):
    window = 4
    state = mtp_state()
    write(tmp_path, v4_config(window), state)
    assert ck.detect_format(tmp_path) == "deepseek-v4-dspark"
    assert DSparkDraftModel.from_pretrained(tmp_path).dtype == torch.bfloat16
    drafter = DSparkDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    config = drafter.config
    assert type(drafter).__name__ == "DeepseekV4DSparkDraftModel"
    assert (config.num_hidden_layers, config.block_size, config.mask_token_id, config.markov_rank) == (3, 5, 3, 8)
    assert drafter.weights_from_target == {"embed_tokens", "lm_head"}
    assert torch.count_nonzero(drafter.confidence_head.proj.bias) == 0  # V4's head has no bias
    s = {k: v.float() for k, v in state.items()}
    s["main_proj"] = s["mtp.0.main_proj.weight"] * s["mtp.0.main_proj.scale"].repeat_interleave(
        FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    with torch.no_grad():  # the target's embedding / head (V4 names `embed`, `head`)
        drafter.embed_tokens.weight.copy_(s["embed.weight"])
        drafter.lm_head.weight.copy_(s["head.weight"])
    drafter.weights_from_target.clear()

    ctx_len = 6  # longer than the window: the block sees only the last 4 context positions
    taps = torch.randn(1, ctx_len, HC, len(TAPS) * H, generator=torch.Generator().manual_seed(5))
    anchor = torch.tensor([7])
    proposal = drafter.draft(anchor, taps, DynamicCache(), position_ids=torch.arange(ctx_len, ctx_len + BLOCK)[None],
                             context_position_ids=torch.arange(ctx_len)[None])
    hidden = reference_hidden(s, torch.tensor([7] + [3] * (BLOCK - 1)), taps[0], torch.arange(ctx_len),
                              torch.arange(ctx_len, ctx_len + BLOCK), window)
    last = f"mtp.{STAGES - 1}."
    prev = torch.cat([anchor, proposal.tokens[0, :-1]])
    code = s[last + "markov_head.embed.weight"][prev]
    expected = hidden @ s["head.weight"].T + code @ s[last + "markov_head.head.weight"].T
    torch.testing.assert_close(proposal.logits[0], expected, rtol=1e-4, atol=1e-4)
    conf = torch.cat([hidden, code], -1) @ s[last + "confidence_head.proj.weight"].T
    torch.testing.assert_close(proposal.confidence_logits[0], conf[:, 0], rtol=1e-4, atol=1e-4)


def test_v4_drafter_drives_a_v4_target_losslessly(tmp_path):
    config = v4_config()
    write(tmp_path, config, mtp_state(seed=1))
    drafter = DSparkDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    fields = {k: v for k, v in config.items()
              if not k.startswith("dspark_") and k not in ("architectures", "model_type", "quantization_config")}
    fields["compress_ratios"] = [0] * 4
    torch.manual_seed(0)
    target = DeepseekV4ForCausalLM(DeepseekV4Config(**fields)).eval()
    # transformers flags every V4 model stateful (CSA/HCA compressor state can't be rolled back). This target has
    # sliding-window layers only and stays inside its 64-token window, where the cache crops exactly.
    target._is_stateful = False
    generator = torch.Generator().manual_seed(3)
    for n in (1, 4, 8):
        ids = torch.randint(4, V, (1, n), generator=generator)
        reference = target.generate(ids, max_new_tokens=16, do_sample=False)
        out = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, reference)
    assert drafter.embed_tokens.weight is target.get_input_embeddings().weight
    assert max(drafter.generation_stats.drafted) == BLOCK

    # native round trip of the remapped drafter (embed / head stay the target's)
    drafter.save_pretrained(tmp_path / "native")
    again = DSparkDraftModel.from_pretrained(tmp_path / "native", dtype=torch.float32)
    assert type(again).__name__ == "DeepseekV4DSparkDraftModel"
    ours = {k: v for k, v in drafter.state_dict().items() if k.split(".")[0] not in ("embed_tokens", "lm_head")}
    theirs = again.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
