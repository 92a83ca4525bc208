"""One GEMM for the projections that read the same input (q/k/v, gate/up) on the fast path.

At batch 1 a decoding step is a chain of matrix-vector products, and on an H200 each costs a few microseconds more
than reading its weight (launch, ramp-up and tail; a 1024-row K/V projection of a 4B-shaped model takes 6-13 µs for
1.3 µs of bytes). Reading q, k and v as one weight, and gate and up as one, saves those per-kernel costs, as vLLM's
`QKVParallelLinear` and gpt-fast's `wqkv` do.

`fuse_projections(model)` copies each group of sibling `nn.Linear`s (`q_proj`/`k_proj`/`v_proj`, `gate_proj`/
`up_proj`) into one weight and makes the members' parameters views of it: no extra memory once the old tensors are
freed (unless something else holds them), and the state dict, its names and values are unchanged. The members'
class becomes `FusedLinear`, which still is an `nn.Linear`. Outside `projection_fusion()` a member runs its own
`F.linear`, exactly as before. Inside it, a group first watches one
forward to learn which members read the same tensor (a DSpark drafter's q reads the block, its k and v read context
+ block), then computes each run of adjacent members sharing an input as one `F.linear` and hands every member its
slice. The model's attention and MLP code is untouched; the projections return the same outputs from fewer GEMMs.
The projections that read alone (`o_proj`, `down_proj`) keep their weights and become `FewRowsLinear`s. Inside the
context, on CUDA with `DSPARK_SKINNY_LINEAR=1`, every such GEMM over at most 16 rows of 16-bit values, a group's
or a single one's, runs `skinny_linear`'s Triton kernel instead of cuBLAS.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .skinny_linear import linear

__all__ = ["FewRowsLinear", "FusedLinear", "fuse_projections", "projection_fusion", "unfuse_projections"]

PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
SINGLE_PROJECTIONS = ("o_proj", "down_proj")  # read alone: kept as they are, the few-rows kernel inside the context
_active = False  # set by projection_fusion(); read (and guarded on) by compiled code


class ProjectionGroup:
    """Sibling linears whose weights are row slices of one `weight` [sum of outputs, in] (and `bias`)."""

    def __init__(self, members: list[nn.Linear]):
        first = members[0].weight
        self.rows = [0]
        for member in members:
            self.rows.append(self.rows[-1] + member.out_features)
        self.weight = torch.empty(self.rows[-1], first.shape[1], dtype=first.dtype, device=first.device)
        has_bias = members[0].bias is not None
        self.bias = torch.empty(self.rows[-1], dtype=first.dtype, device=first.device) if has_bias else None
        self.members = members
        for slot, member in enumerate(members):
            rows = slice(self.rows[slot], self.rows[slot + 1])
            self.weight[rows].copy_(member.weight.detach())
            member.weight = nn.Parameter(self.weight[rows], requires_grad=member.weight.requires_grad)
            if has_bias:
                self.bias[rows].copy_(member.bias.detach())
                member.bias = nn.Parameter(self.bias[rows], requires_grad=member.bias.requires_grad)
            member.__class__ = FusedLinear
            member.fusion, member.slot = self, slot
        self.seen: dict[int, torch.Tensor] = {}  # slot -> input, while learning
        self.runs: dict[int, tuple[int, int]] | None = None  # slot -> (first, last) slot of its shared-input run
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor, set[int]]] = {}  # run start -> (input, out, used)

    def intact(self) -> bool:
        """Whether every member's parameters are still the views made here (`.to()` or a reassignment breaks it)."""
        def is_view(tensor, start):
            return (tensor is not None and tensor.device == self.weight.device and tensor.dtype == self.weight.dtype
                    and tensor.data_ptr() == self.weight.data_ptr() + start * tensor.element_size())

        return all(is_view(member.weight, self.rows[slot] * self.weight.shape[1])
                   and (self.bias is None or is_view(member.bias, self.rows[slot]))
                   for slot, member in enumerate(self.members))

    def learn(self, slot: int, inputs: torch.Tensor) -> None:
        """Records which tensor `slot` read; once every member has been called, fixes the shared-input runs."""
        self.seen[slot] = inputs
        if len(self.seen) < len(self.members):
            return
        runs: list[list[int]] = []
        for member_slot in range(len(self.members)):
            if runs and self.seen[runs[-1][-1]] is self.seen[member_slot]:
                runs[-1].append(member_slot)
            else:
                runs.append([member_slot])
        self.runs = {slot: (run[0], run[-1]) for run in runs if len(run) > 1 for slot in run}
        self.seen = {}

    def output(self, slot: int, inputs: torch.Tensor) -> torch.Tensor:
        """Member `slot`'s output: its slice of one `F.linear` over its run (computed by the run's first caller)."""
        first, last = self.runs[slot]
        start, stop = self.rows[first], self.rows[last + 1]
        kept = self.pending.get(first)
        if kept is None or kept[0] is not inputs or slot in kept[2]:
            bias = self.bias[start:stop] if self.bias is not None else None
            kept = (inputs, linear(inputs, self.weight[start:stop], bias), set())
            self.pending[first] = kept
        kept[2].add(slot)
        if len(kept[2]) == last - first + 1:  # every member of the run has its slice: hold nothing past the forward
            del self.pending[first]
        return kept[1][..., self.rows[slot] - start: self.rows[slot + 1] - start]


class FusedLinear(nn.Linear):
    """An `nn.Linear` whose weight is a slice of its `ProjectionGroup`'s; see the module docstring."""

    fusion: ProjectionGroup
    slot: int

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        fusion = self.fusion
        if _active and fusion.runs is None:  # the first forward in the context runs unfused and watches the inputs
            fusion.learn(self.slot, inputs)
        elif _active and self.slot in fusion.runs:
            return fusion.output(self.slot, inputs)
        return F.linear(inputs, self.weight, self.bias)


class FewRowsLinear(nn.Linear):
    """An `nn.Linear` that, inside `projection_fusion()`, runs `skinny_linear.linear` (the few-rows kernel where it
    applies); its weight is its own."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if _active:
            return linear(inputs, self.weight, self.bias, fused=False)
        return F.linear(inputs, self.weight, self.bias)


def _fusable(members: list[nn.Module], shared: set[int]) -> bool:
    """Plain, hook-free linears with one input size, dtype and device, all with or all without bias, none of whose
    parameters is also another module's (`shared`: ids of parameters registered more than once; fusing would
    untie them)."""
    first = members[0]
    return all(type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook"))
               and m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and m.weight.device.type != "meta"
               and m.weight.is_floating_point() and (m.bias is None) == (first.bias is None)
               and not {id(p) for p in m.parameters()} & shared for m in members)


# model -> its groups as `fuse_projections` last left them: (parent module, member names, group; None for a single
# projection made a FewRowsLinear)
_fused_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _in_place(module: nn.Module, names: list[str], group: ProjectionGroup | None) -> bool:
    """Whether a recorded entry still holds: the group's members under `names` of `module`, intact (a single
    projection: still a `FewRowsLinear`)."""
    if group is None:
        return isinstance(getattr(module, names[0], None), FewRowsLinear)
    return group.members == [getattr(module, name, None) for name in names] and group.intact()


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuses every group of sibling projections in `model` (see the module docstring); a group fused before whose
    parameters were since replaced (`.to()`, loading) is fused anew. Returns the number of groups fused now. When the
    groups of the last call are all in place and intact, it returns 0 at once, without walking the model (the walk
    was most of the fast path's host set-up per call: benchmarks/fast_path_setup.py)."""
    recorded = _fused_groups.get(model)
    if recorded is not None and all(_in_place(*entry) for entry in recorded):
        return 0
    fused, seen, shared, record = 0, set(), set(), []
    for _, parameter in model.named_parameters(remove_duplicate=False):
        (shared if id(parameter) in seen else seen).add(id(parameter))
    for module in model.modules():
        for name in SINGLE_PROJECTIONS:
            member = getattr(module, name, None)
            if isinstance(member, FewRowsLinear) or (isinstance(member, nn.Module) and _fusable([member], shared)):
                member.__class__ = FewRowsLinear
                record.append((module, [name], None))
        for names in PROJECTION_GROUPS:
            present = [name for name in names if isinstance(getattr(module, name, None), nn.Module)]
            members = [getattr(module, name) for name in present]
            if len(members) < 2:
                continue
            if all(isinstance(m, FusedLinear) for m in members):
                group = members[0].fusion
                if group.members == members and group.intact():
                    record.append((module, present, group))
                    continue
                for member in members:
                    _release(member)
            if _fusable(members, shared):
                record.append((module, present, ProjectionGroup(members)))
                fused += 1
    _fused_groups[model] = record
    return fused


def watching(model: nn.Module) -> bool:
    """Whether, with fusion active, a group that `fuse_projections(model)` left has yet to watch its first forward
    (which must run eagerly: not traced)."""
    return _active and any(group is not None and group.runs is None for _, _, group in _fused_groups.get(model, ()))


def _release(member: FusedLinear) -> None:
    """Makes `member` a plain `nn.Linear` again, keeping its parameters as they are."""
    member.__class__ = nn.Linear
    del member.fusion, member.slot


def unfuse_projections(model: nn.Module) -> None:
    """Gives every fused member of `model` its own weight again and makes it a plain `nn.Linear`."""
    _fused_groups.pop(model, None)
    for module in model.modules():
        if isinstance(module, FewRowsLinear):
            module.__class__ = nn.Linear
        elif isinstance(module, FusedLinear):
            with torch.no_grad():
                module.weight = nn.Parameter(module.weight.clone(), requires_grad=module.weight.requires_grad)
                if module.bias is not None:
                    module.bias = nn.Parameter(module.bias.clone(), requires_grad=module.bias.requires_grad)
            _release(module)


@contextlib.contextmanager
def projection_fusion() -> Iterator[None]:
    """Runs the block with fused members computing their groups' shared GEMMs."""
    global _active
    saved, _active = _active, True
    try:
        yield
    finally:
        _active = saved
