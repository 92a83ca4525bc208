"""Fused sibling projections (q/k/v, gate/up as one GEMM): the model computes what it computed before, inside and
outside `projection_fusion()`, eager and traced as one graph; a DSpark drafter's q (block) stays apart from its k/v
(context + block); the state dict, saving and loading are unchanged; a `.to()` that breaks the views is noticed."""

from __future__ import annotations

import pytest
import torch
from tiny_models import install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_target
from torch import nn
from transformers import AutoModelForCausalLM

import dspark_hf  # noqa: F401
from dspark_hf.generation import static_generate
from dspark_hf.generation.fused_projections import (
    FewRowsLinear,
    FusedLinear,
    fuse_projections,
    projection_fusion,
    unfuse_projections,
    watching,
)

IDS = torch.tensor([[5, 9, 11, 4, 30, 8, 17]])


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def groups(model):
    return {id(m.fusion): m.fusion for m in model.modules() if isinstance(m, FusedLinear)}.values()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_target_computes_the_same_and_keeps_its_state_dict(family):
    model = tiny_target(family, vocab_size=48)
    expected, state = logits(model), {k: v.clone() for k, v in model.state_dict().items()}
    layers = model.config.num_hidden_layers
    assert fuse_projections(model) == 2 * layers
    assert fuse_projections(model) == 0  # idempotent
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())
    for layer in model.model.layers:  # the members' weights are consecutive rows of one tensor
        q, k, v = layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj
        assert isinstance(q, nn.Linear) and q.fusion is k.fusion is v.fusion
        assert k.weight.data_ptr() == q.weight.data_ptr() + q.weight.numel() * q.weight.element_size()
        assert layer.mlp.gate_proj.fusion is layer.mlp.up_proj.fusion
        # the projections that read alone keep their weights, their class runs the few-rows kernel in the context
        assert type(layer.self_attn.o_proj) is FewRowsLinear and type(layer.mlp.down_proj) is FewRowsLinear
    assert torch.allclose(logits(model), expected, atol=1e-6, rtol=1e-5)  # outside the context: own F.linear
    with projection_fusion():
        fused = logits(model)
    assert all(g.runs == {slot: (0, len(g.members) - 1) for slot in range(len(g.members))} for g in groups(model))
    assert torch.allclose(fused, expected, atol=1e-6, rtol=1e-5)
    unfuse_projections(model)
    assert not any(isinstance(m, (FusedLinear, FewRowsLinear)) for m in model.modules())
    layer = model.model.layers[0].self_attn
    assert layer.k_proj.weight.untyped_storage().data_ptr() != layer.q_proj.weight.untyped_storage().data_ptr()
    assert torch.allclose(logits(model), expected, atol=1e-6, rtol=1e-5)


def test_a_drafter_fuses_only_the_projections_that_read_the_same_tensor():
    target = make_bigram_like(tiny_target("qwen3", vocab_size=48))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=48), target)
    expected = target.generate(IDS, max_new_tokens=24, do_sample=False)
    assert torch.equal(static_generate(target, drafter, IDS, 24, fuse_projections=True), expected)
    attention = [g for g in groups(drafter) if len(g.members) == 3]
    assert attention and all(g.runs == {1: (1, 2), 2: (1, 2)} for g in attention)  # q: block; k, v: context + block
    assert all(not g.pending for g in groups(drafter)) and all(not g.pending for g in groups(target))
    assert drafter.generation_stats.tau > 1


@pytest.mark.parametrize("with_drafter", [True, False], ids=["dspark", "plain"])
def test_fused_rounds_trace_as_one_graph_with_the_same_tokens(with_drafter):
    target = make_bigram_like(tiny_target("llama", vocab_size=48))
    drafter = tiny_drafter(target, block_size=5, seed=3) if with_drafter else None
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    options = dict(backend=backend, fullgraph=True, dynamic=False)
    got = static_generate(target, drafter, IDS, 20, compile=options, fuse_projections=True)
    assert torch.equal(got, target.generate(IDS, max_new_tokens=20, do_sample=False))
    assert len(graphs) == 2  # the prefill chunk's, then the round's
    linears = [n for n in graphs[1].graph.nodes if n.target is torch._C._nn.linear]
    fused_width = target.config.num_attention_heads * target.config.head_dim + 2 * (
        target.config.num_key_value_heads * target.config.head_dim)
    assert any(n.meta["example_value"].shape[-1] == fused_width for n in linears)  # one GEMM for q, k and v


def test_a_move_that_breaks_the_views_is_noticed_and_fused_anew():
    model = tiny_target("qwen3", vocab_size=48)
    fuse_projections(model)
    model.to(torch.float64)  # replaces every parameter: the members no longer view their group's weight
    expected = logits(model)
    assert not any(g.intact() for g in groups(model))
    assert fuse_projections(model) == 2 * model.config.num_hidden_layers
    with projection_fusion():
        assert torch.allclose(logits(model), expected, atol=1e-12)
    assert all(g.intact() and g.weight.dtype == torch.float64 for g in groups(model))


def test_a_call_with_the_groups_in_place_does_not_walk_the_model(monkeypatch):
    """`fuse_projections` runs on every call of the fast path: while the groups it left last time are in place and
    intact, it checks them alone. A move, a replaced member or `unfuse_projections` sends it through the model again;
    `watching` tells, with fusion active, whether a group has yet to see its first forward."""
    model = tiny_target("qwen3", vocab_size=48)
    layers = model.config.num_hidden_layers
    assert fuse_projections(model) == 2 * layers
    walks, modules = [], model.modules
    monkeypatch.setattr(model, "modules", lambda: walks.append(1) or modules())
    assert fuse_projections(model) == 0 and not walks
    assert not watching(model)  # (fusion not active)
    with projection_fusion():
        assert watching(model)
        logits(model)
        assert not watching(model)
    model.to(torch.float64)
    assert fuse_projections(model) == 2 * layers and len(walks) == 1
    attention = model.model.layers[0].self_attn
    attention.q_proj = nn.Linear(attention.q_proj.in_features, attention.q_proj.out_features, bias=False,
                                 dtype=torch.float64)
    fuse_projections(model)
    assert len(walks) == 2 and fuse_projections(model) == 0 and len(walks) == 2
    attention.o_proj = nn.Linear(attention.o_proj.in_features, attention.o_proj.out_features, bias=False,
                                 dtype=torch.float64)  # a replaced single projection is noticed too
    fuse_projections(model)
    assert len(walks) == 3 and type(attention.o_proj) is FewRowsLinear
    unfuse_projections(model)
    unfused = logits(model)
    assert fuse_projections(model) == 2 * layers and len(walks) == 5  # (unfusing walks too)
    with projection_fusion():
        assert torch.allclose(logits(model), unfused, atol=1e-12)


def test_a_fused_model_saves_and_loads_as_before(tmp_path):
    model = tiny_target("qwen3", vocab_size=48)
    expected = logits(model)
    fuse_projections(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, FusedLinear) for m in loaded.modules())
    assert torch.allclose(logits(loaded), expected, atol=1e-6, rtol=1e-5)


def test_projections_shared_with_another_module_stay_as_they_are():
    model = tiny_target("llama", vocab_size=48)
    first, second = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    second.k_proj.weight = first.k_proj.weight  # tied across layers: fusing either group would untie them
    expected = logits(model)
    assert fuse_projections(model) == 2 * model.config.num_hidden_layers - 2
    assert not isinstance(first.k_proj, FusedLinear) and not isinstance(second.q_proj, FusedLinear)
    assert second.k_proj.weight is first.k_proj.weight
    with projection_fusion():
        assert torch.allclose(logits(model), expected, atol=1e-6, rtol=1e-5)
