"""DeepSeek-V4 DSpark heads (`mtp.{0,1,2}.*` inside a V4 checkpoint) at tiny size: load with the remap, block
logits equal the V4 block maths written out here, taps read the target's raw hyper-connection streams (its last layer
included), and the drafter drives a tiny transformers V4 target with compressor layers losslessly."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tiny_models import install_bigram_oracle, make_bigram_like
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

import dspark_hf  # noqa: F401
import dspark_hf.checkpoints as ck
from dspark_hf import DSparkDraftModel
from dspark_hf.generation.target_features import target_is_stateful
from dspark_hf.models import TargetLayerTap

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


def mtp_state(seed: int = 0, markov_rank: int = 8) -> dict[str, torch.Tensor]:
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
                  last + "hc_head_scale": 1 + rand(1), last + "markov_head.embed.weight": rand(V, markov_rank),
                  last + "markov_head.head.weight": rand(V, markov_rank),
                  last + "confidence_head.proj.weight": rand(1, H + markov_rank)})
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


WINDOW, NEW_TOKENS = 8, 32


def v4_target() -> DeepseekV4ForCausalLM:
    """A tiny transformers V4 target, float32: sliding window 8 in every layer; layer 1 adds CSA (compress rate 4, the
    indexer keeps the top 2 entries), layer 2 HCA (rate 8); hash routing in layer 0; no eos; nearly bigram (damped
    layer outputs) so that a bigram-oracle drafter gets long accepts."""
    fields = {k: v for k, v in v4_config(WINDOW).items()
              if not k.startswith("dspark_") and k not in ("architectures", "model_type", "quantization_config")}
    fields.update(compress_ratios=[0, 4, 128, 0], compress_rate_hca=8, index_topk=2, num_hash_layers=1,
                  eos_token_id=None)
    torch.manual_seed(0)
    target = DeepseekV4ForCausalLM(DeepseekV4Config(**fields)).eval()
    assert target.config.layer_types[1:3] == ["compressed_sparse_attention", "heavily_compressed_attention"]
    return make_bigram_like(target, damping=0.3)


def v4_drafter(folder, taps: list[int], oracle_for=None) -> DSparkDraftModel:
    """The published layout with taps `taps`; with `oracle_for`, a full-rank Markov head set to that target's bigram
    table (a good drafter), else random heads (nearly every draft rejected)."""
    config = {**v4_config(WINDOW), "dspark_target_layer_ids": taps}
    if oracle_for is not None:
        config["dspark_markov_rank"] = V
    write(folder, config, mtp_state(seed=1, markov_rank=config["dspark_markov_rank"]))
    drafter = DSparkDraftModel.from_pretrained(folder, dtype=torch.float32)
    return drafter if oracle_for is None else install_bigram_oracle(drafter, oracle_for)


def test_taps_read_the_v4_streams_raw_including_the_last_layer():
    """A tap is the [B, T, hc_mult, H] residual stream a decoder layer returns: transformers' own `hidden_states` for
    every layer but the last, which transformers returns only after `hc_head` and the final norm."""
    target = v4_target()
    ids = torch.randint(4, V, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), TargetLayerTap(target, [-1, 1, 3]) as tap:
        full = target(ids, output_hidden_states=True).hidden_states  # embedding streams first, then each layer
        features = tap.features()
        assert features.shape == (1, 11, HC, 3 * H)
        torch.testing.assert_close(features[..., :H], full[0])
        torch.testing.assert_close(features[..., H : 2 * H], full[2])
        last = features[..., 2 * H :]
        torch.testing.assert_close(target.model.norm(target.model.hc_head(last)), full[-1])


def test_v4_drafter_drives_a_v4_target_with_compressors_losslessly(tmp_path):
    """V4's compressor state cannot be cropped back (transformers < 5.25 flags the model `_is_stateful`, later releases
    mark its cache layers not croppable), so generate() runs dspark_hf's stateful loop: cache copy before verifying,
    restore and re-feed after a partial accept. Prompts of 1, 6 and 20 tokens plus 32 new ones fill the window, close
    CSA/HCA windows and outgrow the indexer's top-k. The taps include the target's last layer."""
    target = v4_target()
    assert target_is_stateful(target)
    drafters = {"random": v4_drafter(tmp_path / "random", [0, 2, 3]),
                "oracle": v4_drafter(tmp_path / "oracle", [0, 2, 3], oracle_for=target)}
    rounds = {name: [] for name in drafters}
    generator = torch.Generator().manual_seed(3)
    for n in (1, 6, 20):
        ids = torch.randint(4, V, (1, n), generator=generator)
        reference = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert reference.shape[1] == n + NEW_TOKENS
        for name, drafter in drafters.items():
            out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter)
            assert torch.equal(out, reference), (name, n)
            stats = drafter.generation_stats
            rounds[name] += list(zip(stats.drafted[:-1], stats.accepted[:-1]))
        # sampling sanity: top_k=1 makes the target's processed distribution one-hot, so sampling equals greedy
        sampled = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=1,
                                  assistant_model=drafters["oracle"])
        assert torch.equal(sampled, reference)
    assert "_is_stateful" not in vars(target)  # the flag is only shadowed while transformers < 5.25 validates
    assert any(0 < a < d for d, a in rounds["oracle"]) and any(0 < a == d for d, a in rounds["oracle"])
    assert (0, 0) in rounds["random"]  # a round verifying no drafts flushed the re-fed tokens
    oracle = drafters["oracle"]
    assert oracle.embed_tokens.weight is target.get_input_embeddings().weight
    assert sum(oracle.generation_stats.committed) / oracle.generation_stats.rounds > 2.0


def test_v4_drafter_round_trips_natively(tmp_path):
    config = v4_config()
    write(tmp_path, config, mtp_state(seed=1))
    drafter = DSparkDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    drafter.save_pretrained(tmp_path / "native")
    again = DSparkDraftModel.from_pretrained(tmp_path / "native", dtype=torch.float32)
    assert type(again).__name__ == "DeepseekV4DSparkDraftModel"
    ours = {k: v for k, v in drafter.state_dict().items() if k.split(".")[0] not in ("embed_tokens", "lm_head")}
    theirs = again.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
