"""`compile_layers_once(target)`: torch.compile traces a target's decoder layer once, not once per layer.

Inductor compiles a function's whole graph: a round of a 36-layer target inlines 36 copies of the decoder layer.
`torch.compiler.nested_compile_region` marks a function whose traced graph is reused at every call with the same
input metadata (hierarchical compilation); outside torch.compile it does nothing. Here every layer of each stack of
like layers (an `nn.ModuleList` of modules of one class) gets a subclass whose `forward` is that class's forward so
marked, one subclass per class, so that all of them call one region. On the H200 with torch 2.11 a static engine's
warm-up for a Qwen3-4B-shaped target took 11-22 % less time, its rounds as fast as before (docs/serving.md).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models import DSparkDraftModel

_REGION_CLASSES: dict[type, type] = {}


def _region_class(base: type) -> type:
    """`base` with its forward marked as a nested compile region (one subclass per base class, named like it)."""
    if getattr(base, "_compiled_once", False):
        return base
    if base not in _REGION_CLASSES:
        forward = torch.compiler.nested_compile_region(base.forward)
        _REGION_CLASSES[base] = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                                              "_compiled_once": True})
    return _REGION_CLASSES[base]


def compile_layers_once(target: nn.Module) -> int:
    """Marks each layer of every stack of like layers in `target` (an `nn.ModuleList` of two or more modules of
    one class) as one nested compile region per class; returns how many layers are marked (marked ones count
    again). Weights, state dict and results are unchanged. Call it before the first compiled call (e.g. before
    `DSparkEngine.warm_up`). A DSpark drafter is refused: with fused projections its attention's shared K/V
    projection breaks the regions' no-aliasing rule, and its few layers cost little to compile."""
    if isinstance(target, DSparkDraftModel):
        raise ValueError("compile_layers_once() marks a target's decoder layers; a DSpark drafter's layers are "
                         "compiled inline (pass the target).")
    if not hasattr(torch.compiler, "nested_compile_region"):
        raise ValueError(f"compile_layers_once() needs torch.compiler.nested_compile_region (torch >= 2.8); this is "
                         f"torch {torch.__version__}.")
    marked = 0
    for stack in target.modules():
        kinds = {type(layer) for layer in stack} if isinstance(stack, nn.ModuleList) and len(stack) > 1 else ()
        if len(kinds) == 1:
            region = _region_class(kinds.pop())
            for layer in stack:
                layer.__class__ = region
            marked += len(stack)
    return marked
