"""The static-cache attention kernel (`generation/static_attention.py`) under TRITON_INTERPRET=1 (CPU): the same
output as transformers' SDPA attention for boolean, additive and no masks, GQA, one and several cache slices, keys
outside a row's bounds not visited; and
`static_generate` with it produces the same tokens as with the model's own attention. Skipped without triton."""

from __future__ import annotations

import types

# first: switches the interpreter on
from triton_interpreter import CountingKernel, child_only, interp, run_in_child_process

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny_models import install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_target  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from dspark_hf.generation import static_attention, static_generate, static_generate_batch  # noqa: E402
from dspark_hf.generation.static_attention import static_cache_attention  # noqa: E402


@child_only
def test_in_child_process():
    run_in_child_process(__file__, timeout=600)


def attention_case(batch, heads, kv_heads, queries, keys, head_dim, mask_kind, module_causal=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=module_causal)
    query = torch.randn(batch, queries, heads, head_dim, generator=generator).transpose(1, 2)  # as transformers has it
    key = torch.randn(batch, kv_heads, keys, head_dim, generator=generator)
    value = torch.randn(batch, kv_heads, keys, head_dim, generator=generator)
    mask = None
    if mask_kind == "bool":  # a static cache: each row's valid prefix, causal within the new queries
        ends = torch.randint(queries, keys, (batch,), generator=generator)
        visible = ends[:, None, None] - queries + 1 + torch.arange(queries)[None, :, None]
        mask = (torch.arange(keys)[None, None, :] < visible)[:, None]
    elif mask_kind == "additive":  # the drafter's kind: -inf holes and finite biases, broadcast over the batch
        mask = torch.randn(1, 1, queries, keys, generator=generator)
        mask = mask.masked_fill(torch.rand(1, 1, queries, keys, generator=generator) < 0.3, float("-inf"))
        mask[..., 0] = 0.0
    return module, query, key, value, mask


@interp
@pytest.mark.parametrize("slices", ["one", "several"])
@pytest.mark.parametrize("shape,mask_kind,module_causal", [
    ((1, 8, 4, 1, 272, 64), "bool", True),  # plain decoding step
    ((1, 8, 4, 8, 272, 64), "bool", True),  # a verify forward over γ + 1 tokens
    ((2, 4, 2, 3, 100, 32), "additive", True),
    ((1, 4, 4, 5, 40, 16), None, True),  # no mask: causal, top-left as SDPA
    ((1, 4, 2, 5, 70, 16), None, False),  # no mask, non-causal module: every key
    ((1, 16, 4, 4, 130, 32), "bool", True),  # 16 query rows per program
])
def test_same_output_as_sdpa(shape, mask_kind, module_causal, slices, monkeypatch):
    monkeypatch.setattr(static_attention, "_sm_count", lambda device: 1 if slices == "one" else 64)
    module, query, key, value, mask = attention_case(*shape, mask_kind, module_causal)
    launches = []
    monkeypatch.setattr(static_attention, "_attend_slice", CountingKernel(static_attention._attend_slice, launches))
    ours, _ = static_cache_attention(module, query, key, value, mask, scaling=0.3)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == reference.shape == (shape[0], shape[3], shape[1], shape[5])
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert len(launches) == 1 and (launches[0][1] > 1) == (slices == "several" and shape[4] > 64)


@interp
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_tiles_no_query_sees_are_not_read(mask_kind):
    """Static-cache rows (left padding, then a written prefix, then unwritten columns) hold NaN in every 64-key tile
    that their mask hides entirely: the kernel does not read those tiles (reading them would spread the NaN into the
    output), and the output equals SDPA's with those keys zeroed. An additive mask hides with the dtype's lowest value,
    as `visible_columns` and transformers build it."""
    batch, heads, kv_heads, queries, keys, head_dim = 3, 8, 4, 4, 272, 32
    module, query, key, value, _ = attention_case(batch, heads, kv_heads, queries, keys, head_dim, None)
    pad, end = torch.tensor([70, 0, 130]), torch.tensor([150, 60, 200])  # row b sees pad_b .. end_b + query
    columns = torch.arange(keys)
    seen = (columns >= pad[:, None, None]) & (columns <= end[:, None, None] + torch.arange(queries)[:, None])
    mask = seen[:, None]
    if mask_kind == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    tiles = columns // 64
    key_seen = seen.any(dim=1)  # [B, K]: keys some query of row b sees
    tile_seen = torch.stack([key_seen[:, tiles == tile].any(dim=1) for tile in range(int(tiles.max()) + 1)], dim=1)
    hidden = (~tile_seen[:, tiles])[:, None, :, None]  # [B, 1, K, 1]: keys in tiles no query of the row sees
    assert hidden.sum(dim=2).flatten().tolist() == [64 + 64 + 16, 3 * 64 + 16, 64 + 64 + 16]
    zeroed = (key.masked_fill(hidden, 0.0), value.masked_fill(hidden, 0.0))
    poisoned = (key.masked_fill(hidden, float("nan")), value.masked_fill(hidden, float("nan")))
    ours, _ = static_cache_attention(module, query, *poisoned, mask, scaling=0.3)
    reference, _ = sdpa_attention_forward(module, query, *zeroed, mask, scaling=0.3)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@interp
@pytest.mark.parametrize("slices", ["one", "several"])
def test_key_bounds_keep_the_kernel_to_each_rows_keys(slices, monkeypatch):
    """`key_bounds` [B, 2]: the kernel visits only the keys from row b's first bound (rounded down to a tile) to its
    second. Here the mask shows every key and the keys outside the bounds hold NaN: the output is SDPA's over the
    bounded keys alone, so the keys outside were neither read nor counted."""
    monkeypatch.setattr(static_attention, "_sm_count", lambda device: 1 if slices == "one" else 64)
    module, query, key, value, _ = attention_case(3, 8, 4, 2, 300, 32, None)
    bounds = torch.tensor([[64, 150], [0, 300], [128, 129]])  # (tile-aligned first bounds: the rounding is moot)
    inside = (torch.arange(300) >= bounds[:, :1]) & (torch.arange(300) < bounds[:, 1:])  # [B, K]
    outside = ~inside[:, None, :, None]
    poisoned = (key.masked_fill(outside, float("nan")), value.masked_fill(outside, float("nan")))
    everything = torch.ones(3, 1, 2, 300, dtype=torch.bool)
    ours, _ = static_cache_attention(module, query, *poisoned, everything, scaling=0.3, key_bounds=bounds)
    reference, _ = sdpa_attention_forward(module, query, key, value, inside[:, None, None, :].expand(3, 1, 2, 300),
                                          scaling=0.3)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    strided = torch.cat([bounds, bounds[:, :1]], dim=1)[:, :2]  # (row stride 3: the same bounds as a view)
    ours, _ = static_cache_attention(module, query, *poisoned, everything, scaling=0.3, key_bounds=strided)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    unbounded, _ = static_cache_attention(module, query, key, value, everything, scaling=0.3)
    assert not torch.allclose(unbounded, reference)  # (the bounds changed what was attended)


@interp
def test_what_the_kernel_does_not_cover_runs_sdpa(monkeypatch):
    launches = []
    monkeypatch.setattr(static_attention, "_attend_slice", CountingKernel(static_attention._attend_slice, launches))
    module, query, key, value, mask = attention_case(1, 4, 2, 40, 60, 16, "bool")  # 80 rows per program: a prefill
    ours, _ = static_cache_attention(module, query, key, value, mask)
    torch.testing.assert_close(ours, sdpa_attention_forward(module, query, key, value, mask)[0])
    module, query, key, value, mask = attention_case(1, 4, 2, 2, 60, 8, "bool")  # head size 8
    static_cache_attention(module, query, key, value, mask)
    static_cache_attention(module, query, key, value, mask, dropout=0.1)
    assert launches == []


@interp
def test_compiled_callers_get_the_kernels_as_one_opaque_operator(monkeypatch):
    """torch.compile must not trace the kernel launches: inductor did before, and on an H200 the split path's
    attention came out wrong inside the compiled engine rounds (docs/serving_measurements.md). The graph calls the
    custom operator `dspark_hf::split_kv_attention`, which gives the eager output."""
    monkeypatch.setattr(static_attention, "_sm_count", lambda device: 64)
    module, query, key, value, mask = attention_case(1, 8, 4, 8, 272, 64, "bool")
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module

    compiled = torch.compile(lambda *tensors, **bounds: static_cache_attention(module, *tensors, scaling=0.3,
                                                                               **bounds)[0],
                             backend=recording_backend, fullgraph=True)
    ours = compiled(query, key, value, mask)
    eager, _ = static_cache_attention(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(ours, eager, rtol=0, atol=0)
    bounds = torch.tensor([[0, 272]])  # (every key: the same output, through the operator's optional argument)
    torch.testing.assert_close(compiled(query, key, value, mask, key_bounds=bounds), eager, rtol=0, atol=0)
    called = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert any("dspark_hf.split_kv_attention" in target for target in called), called


@interp
def test_static_generate_with_the_kernel_gives_the_same_tokens(monkeypatch):
    target = make_bigram_like(tiny_target("qwen3", vocab_size=48, eos_token_id=2, head_dim=16))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=48, head_dim=16), target)
    launches = []
    monkeypatch.setattr(static_attention, "_attend_slice", CountingKernel(static_attention._attend_slice, launches))
    ids = torch.tensor([[5, 9, 11, 4, 30, 8]])
    for model in (None, drafter):
        expected = static_generate(target, model, ids, 20, attention="model")
        assert not launches
        assert torch.equal(static_generate(target, model, ids, 20, attention="static_kernel"), expected)
        assert launches  # the target's decoding steps (and the drafter's block) ran the kernel
        launches.clear()
    assert target.config._attn_implementation == "sdpa" and drafter.config._attn_implementation == "sdpa"


@interp
def test_static_generate_batch_with_the_kernel_and_fused_projections_gives_the_same_tokens(monkeypatch):
    """Left-padded rows of different lengths: each row's additive mask (its own padding and write position) reaches
    the kernel, and the fast path's kernels change no row's tokens. (A random target: its tokens depend on every
    visible column, so a mask the kernel got wrong would show.)"""
    target = tiny_target("qwen3", vocab_size=48, eos_token_id=2, head_dim=16)
    drafter = tiny_drafter(target, block_size=5, head_dim=16)
    launches = []
    monkeypatch.setattr(static_attention, "_attend_slice", CountingKernel(static_attention._attend_slice, launches))
    prompts = [[5, 9, 11, 4, 30, 8, 7, 12], [6, 13], [20, 21, 22, 23, 24]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    bounded = []
    kernel_call = static_attention.split_kv_attention
    monkeypatch.setattr(static_attention, "split_kv_attention",
                        lambda *args: bounded.append(args[6] is not None) or kernel_call(*args))
    for model in (None, drafter):
        expected = static_generate_batch(target, model, ids, mask, 16, attention="model", fuse_projections=False)
        assert not launches
        got = static_generate_batch(target, model, ids, mask, 16, attention="static_kernel", fuse_projections=True)
        assert got == expected
        assert launches  # the target's decoding steps (and the drafter's block) ran the kernel
        assert any(bounded)  # the target's forwards gave each row's key bounds (the drafter's do not)
        launches.clear()
        bounded.clear()
    assert target.config._attn_implementation == "sdpa" and drafter.config._attn_implementation == "sdpa"
