"""`compile_layers_once`: a target's decoder layers become one nested compile region, traced once and called per
layer, with unchanged results (eager, compiled, and in a compiled static round that writes its caches in place)."""

import pytest
import torch
from tiny_models import tiny_drafter, tiny_target

from dspark_hf.generation import compile_layers_once, static_generate_batch
from dspark_hf.generation.compile_regions import _region_class


def region_calls(graph: torch.fx.GraphModule) -> list[torch.nn.Module]:
    """The subgraph modules of every nested-region call in a traced graph, in call order."""
    return [getattr(graph, node.args[0].target) for node in graph.graph.nodes
            if node.op == "call_function" and "invoke_subgraph" in str(node.target)]


def recording_backend(then: str | None = None):
    """A torch.compile backend that records each traced graph, then runs it as it is or through backend `then`."""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return torch._dynamo.lookup_backend(then)(graph, example_inputs) if then else graph.forward

    return graphs, backend


def test_marked_layers_are_compiled_once_and_called_per_layer():
    """Four Qwen3 layers: unmarked, the traced forward has no region call; marked, it has four calls of one
    subgraph. Logits equal eager before and after; state dict names and values are unchanged; marking again marks
    the same layers (no subclass of the subclass); an unmarked model of the same class is left alone."""
    target = tiny_target("qwen3", num_hidden_layers=4)
    ids = torch.randint(4, 96, (2, 6), generator=torch.Generator().manual_seed(0))
    before = target(ids, use_cache=False).logits
    state = {name: tensor.clone() for name, tensor in target.state_dict().items()}

    def traced() -> tuple[torch.fx.GraphModule, torch.Tensor]:
        graphs, backend = recording_backend()
        torch._dynamo.reset()
        logits = torch.compile(lambda x: target(x, use_cache=False).logits, backend=backend, fullgraph=True)(ids)
        assert len(graphs) == 1
        return graphs[0], logits

    graph, logits = traced()
    assert region_calls(graph) == [] and torch.equal(logits, before)
    layer_class = type(target.model.layers[0])
    assert compile_layers_once(target) == 4
    assert all(type(layer) is _region_class(layer_class) for layer in target.model.layers)
    assert isinstance(target.model.layers[0], layer_class)
    assert type(target.model.layers[0]).__name__ == layer_class.__name__
    graph, logits = traced()
    calls = region_calls(graph)
    assert len(calls) == 4 and len({id(module) for module in calls}) == 1
    assert torch.equal(logits, before) and torch.equal(target(ids, use_cache=False).logits, before)
    assert target.state_dict().keys() == state.keys()
    assert all(torch.equal(tensor, state[name]) for name, tensor in target.state_dict().items())
    assert compile_layers_once(target) == 4 and type(target.model.layers[0]) is _region_class(layer_class)
    assert type(tiny_target("qwen3", num_hidden_layers=2).model.layers[0]) is layer_class
    with pytest.raises(ValueError, match="target"):
        compile_layers_once(tiny_drafter(target))


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma"])
def test_compiled_static_rounds_with_marked_layers_decode_the_same_tokens(family):
    """The batched static rounds (drafter, Markov loop, target forward writing each row's cache columns in place,
    acceptance) through AOT autograd with the target's layers marked: one region for the target's layers in the
    round graph, and the tokens of the uncompiled loop."""
    target = tiny_target(family, num_hidden_layers=4)
    drafter = tiny_drafter(target, block_size=4, markov_rank=8, target_layer_ids=(0, 2))
    ids = torch.randint(4, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    expected = static_generate_batch(target, drafter, ids, None, 20)
    compile_layers_once(target)
    graphs, backend = recording_backend(then="aot_eager")
    torch._dynamo.reset()
    tokens = static_generate_batch(target, drafter, ids, None, 20,
                                   compile=dict(backend=backend, fullgraph=True, dynamic=False))
    assert tokens == expected
    rounds = [graph for graph in graphs if len(region_calls(graph)) == 4]
    assert rounds and all(len({id(module) for module in region_calls(graph)}) == 1 for graph in rounds)
