"""Where a drafter lives next to a big target, and how it uses the target's input embedding and LM head from there.

A target may be split by accelerate (`device_map=...`: layers on several devices, some offloaded to the CPU or disk
with their weights on "meta" until a forward loads them), or quantized (bitsandbytes). The drafter:

- goes next to the target's LM head (`lm_head_device`) when it is still on the CPU while that head runs on an
  accelerator; a drafter you moved yourself (`drafter.to("cuda:0")`) stays where you put it;
- shares the target's embedding and LM head (`share_target_weights`): as the same `Parameter` when the weight is a
  plain float tensor on the drafter's device (no copy), otherwise through a view (`TargetEmbeddingView`,
  `TargetHeadView`) that computes on the weight's own device, loading an offloaded weight for the duration of the
  call exactly as the target's forward does, and moves only the small result (embedded block rows, block logits) to
  the drafter. A quantized LM head is called as a module (a bitsandbytes `Linear4bit`/`Linear8bitLt` computes
  `x @ W.T` with its dequantized weight); a quantized embedding cannot be looked up and is refused. A head sharded
  by tensor parallelism (`tp_plan="auto"`, a `DTensor` weight) is called as a module too: its hooks gather the full
  logits on every rank, and every rank drafts the same tokens.

The drafter's draft probabilities stay exactly the distribution its tokens are drawn from wherever these weights
live, so verification stays lossless; only the drafter's acceptance can change with the target's numerics.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.func import functional_call

_COMPARE_ROWS = 4096  # rows per chunk when checking that a drafter's own copy equals the target's weight


def _hooks(module: nn.Module) -> list:
    """accelerate hooks attached to `module` (a `SequentialHook` is flattened)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])


def _as_device(device) -> torch.device:
    """accelerate's device names: a `torch.device`, a string, or an accelerator index (CUDA unless another
    accelerator is present)."""
    if isinstance(device, int):
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return torch.device(accelerator.type if accelerator is not None else "cuda", device)
    return torch.device(device)


def is_offloaded(module: nn.Module) -> bool:
    """Whether accelerate keeps the module's weights off-device (on "meta") between forwards."""
    weight = getattr(module, "weight", None)
    return any(getattr(hook, "offload", False) for hook in _hooks(module)) or (
        weight is not None and weight.device.type == "meta"
    )


def execution_device(module: nn.Module) -> torch.device | None:
    """The device the module computes on: its accelerate hook's execution device, else its weight's device."""
    for hook in _hooks(module):
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return _as_device(device)
    weight = getattr(module, "weight", None)
    if weight is not None and weight.device.type != "meta":
        return weight.device
    return None


def is_quantized(module: nn.Module) -> bool:
    """Whether the module's weight is stored quantized (bitsandbytes 4/8-bit, FP8, any packed integer format)."""
    weight = getattr(module, "weight", None)
    return (
        weight is None
        or not weight.is_floating_point()
        or weight.element_size() < 2
        or hasattr(weight, "quant_state")
        or hasattr(weight, "SCB")
        or type(module).__module__.startswith("bitsandbytes")
    )


def is_distributed(module: nn.Module) -> bool:
    """Whether the module's weight is a `DTensor` (sharded by transformers' tensor parallel, `tp_plan="auto"`): its
    forward, with the tensor-parallel hooks, computes the full result on every rank."""
    weight = getattr(module, "weight", None)
    if weight is None or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def logical_shape(module: nn.Module) -> tuple[int, ...]:
    """The weight shape a module computes with (a quantized weight is stored packed)."""
    if isinstance(module, nn.Embedding):
        return (module.num_embeddings, module.embedding_dim)
    if isinstance(module, nn.Linear):
        return (module.out_features, module.in_features)
    if isinstance(module, (TargetEmbeddingView, TargetHeadView)):
        return logical_shape(module.target_module)
    return tuple(module.weight.shape)


@contextmanager
def loaded_weight(module: nn.Module):
    """The module's weight as a real tensor on its execution device; an accelerate-offloaded weight is loaded for the
    duration of the `with` block (the hook's own pre/post-forward, as in the target's forward) and released after."""
    hooks = [hook for hook in _hooks(module) if getattr(hook, "offload", False)]
    for hook in hooks:
        hook.pre_forward(module)
    try:
        yield module.weight
    finally:
        for hook in reversed(hooks):
            hook.post_forward(module, None)


class TargetEmbeddingView(nn.Module):
    """The drafter's embedding (its own lookup semantics, e.g. Gemma's scale) over the target's embedding weight, which
    may be offloaded or on another device: the rows of the block's tokens are gathered there and moved here."""

    def __init__(self, own: nn.Module, target_module: nn.Module):
        super().__init__()
        own._parameters.pop("weight", None)  # the drafter's copy goes; the target's weight is used instead
        own.padding_idx = None  # rows are re-indexed per call (padding_idx only matters for gradients)
        self.own = own
        object.__setattr__(self, "target_module", target_module)  # not a submodule: never saved or moved with us

    @property
    def weight(self) -> torch.Tensor:
        return self.target_module.weight

    def forward(self, input_ids: torch.LongTensor) -> torch.Tensor:
        unique, inverse = torch.unique(input_ids, return_inverse=True)
        if is_distributed(self.target_module):  # a plain nn.Embedding (checked when shared): its forward is the lookup
            device = execution_device(self.target_module) or input_ids.device
            rows = self.target_module(unique.to(device)).to(input_ids.device)
        else:
            with loaded_weight(self.target_module) as weight:
                rows = weight[unique.to(weight.device)].to(input_ids.device)
        return functional_call(self.own, {"weight": rows}, (inverse,))


class TargetHeadView(nn.Module):
    """The target's LM head as the drafter's: `hidden @ W.T` on the weight's device (an offloaded weight is loaded for
    the call), a quantized head called as its module; the logits come back to the hidden states' device."""

    def __init__(self, target_module: nn.Module):
        super().__init__()
        object.__setattr__(self, "target_module", target_module)

    @property
    def weight(self) -> torch.Tensor:
        return self.target_module.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        module = self.target_module
        if is_quantized(module) or is_distributed(module):
            device = execution_device(module) or hidden_states.device
            return module(hidden_states.to(device)).to(hidden_states.device)
        with loaded_weight(module) as weight:
            logits = nn.functional.linear(hidden_states.to(weight.device, weight.dtype), weight)
        return logits.to(hidden_states.device)


def drafter_device(drafter: nn.Module) -> torch.device:
    """Where the drafter computes (its block-feature projection `fc`, never shared with the target)."""
    return drafter.fc.weight.device


def _module_name(model: nn.Module, module: nn.Module) -> str | None:
    return next((name for name, candidate in model.named_modules() if candidate is module), None)


def lm_head_device(target: nn.Module) -> torch.device:
    """The device the target's LM head computes on: its accelerate hook's execution device, else its entry in
    `target.hf_device_map` ("cpu"/"disk" entries of a model with accelerator parts run on the main device), else its
    weight's device."""
    head = target.get_output_embeddings()
    if head is None:
        return target.device
    for hook in _hooks(head):
        if getattr(hook, "execution_device", None) is not None:
            return _as_device(hook.execution_device)
    device_map = getattr(target, "hf_device_map", None) or {}
    name = _module_name(target, head)
    matches = [key for key in device_map if key == "" or name == key or name.startswith(key + ".")]
    if name is not None and matches:
        value = device_map[max(matches, key=len)]
        if value not in ("cpu", "disk"):
            return _as_device(value)
    return execution_device(head) or target.device


def place_next_to_target(drafter: nn.Module, target: nn.Module) -> torch.device:
    """Moves a drafter that is still on the CPU next to the target's LM head when that head runs on an accelerator;
    leaves a drafter the user placed (any non-CPU device) alone. Weights shared with the target never move. Returns
    the drafter's device."""
    if target.device.type == "meta":
        raise ValueError(
            "The target's first weights (its input embedding) are offloaded, so target.device is 'meta': "
            "transformers' assisted decoding moves the tokens to target.device. Keep the input embedding on a device "
            "(e.g. device_map={'model.embed_tokens': 0, ...}); offloading later layers and the LM head is fine."
        )
    here, head = drafter_device(drafter), lm_head_device(target)
    if here.type != "cpu" or head.type in ("cpu", "meta"):
        return here
    theirs = {id(tensor) for tensor in target.parameters()}
    borrowed = []  # the target's Parameters the drafter holds: detached while the drafter moves
    for module in drafter.modules():
        for key, tensor in list(module._parameters.items()):
            if tensor is not None and id(tensor) in theirs:
                borrowed.append((module, key, tensor))
                module._parameters[key] = None
    try:
        drafter.to(head)
    finally:
        for module, key, tensor in borrowed:
            module._parameters[key] = tensor
    return head


def _same_values(ours: nn.Module, theirs: nn.Module) -> bool:
    """Whether the drafter's own weight equals the target's (compared chunk-wise on the drafter's device)."""
    mine = ours.weight
    if is_quantized(theirs) or mine.device.type == "meta":
        return False
    with loaded_weight(theirs) as weight:
        if weight.dtype != mine.dtype or weight.shape != mine.shape:
            return False
        if is_distributed(theirs):
            weight = weight.full_tensor()  # a collective: every rank shares at the same point
        return all(
            torch.equal(weight[start:start + _COMPARE_ROWS].to(mine.device), mine[start:start + _COMPARE_ROWS])
            for start in range(0, mine.shape[0], _COMPARE_ROWS)
        )


def share_target_weights(drafter: nn.Module, target: nn.Module) -> list[str]:
    """`DSparkDraftModel.share_target_weights` (see there): places the drafter, then shares each of `embed_tokens` and
    `lm_head` the drafter lacks (`drafter.weights_from_target`) or holds an identical copy of. Returns the names
    shared."""
    place_next_to_target(drafter, target)
    home = drafter_device(drafter)
    shared = []
    pairs = (("embed_tokens", target.get_input_embeddings()), ("lm_head", target.get_output_embeddings()))
    for name, theirs in pairs:
        ours = getattr(drafter, name)
        needed = name in drafter.weights_from_target
        if theirs is None or getattr(theirs, "weight", None) is None:
            if needed:
                raise ValueError(f"The drafter has no {name} weights and the target exposes none to share.")
            continue
        direct = (not is_quantized(theirs) and not is_offloaded(theirs) and not is_distributed(theirs)
                  and theirs.weight.device == home)
        if getattr(ours, "target_module", None) is theirs or (ours.weight is theirs.weight and direct):
            shared.append(name)
            continue
        needed = needed or ours.weight is theirs.weight  # shared before, but the drafter has moved since
        if logical_shape(theirs) != logical_shape(ours):
            if needed:
                raise ValueError(
                    f"The drafter needs the target's {name} ({tuple(logical_shape(ours))}) but the target's has "
                    f"shape {tuple(logical_shape(theirs))}."
                )
            continue
        if not needed and (isinstance(ours, (TargetEmbeddingView, TargetHeadView)) or not _same_values(ours, theirs)):
            continue  # the drafter keeps its own, different weights
        if name == "embed_tokens" and is_quantized(theirs):
            raise ValueError(
                f"The target's input embedding is quantized ({type(theirs).__name__}, {theirs.weight.dtype}); the "
                "drafter needs float embedding rows. Keep the target's embedding unquantized (bitsandbytes does by "
                "default) or use a drafter checkpoint that includes its own embed_tokens."
            )
        if name == "embed_tokens" and is_distributed(theirs) and type(theirs) is not nn.Embedding:
            raise ValueError(
                f"The target's input embedding is sharded by tensor parallelism and is a {type(theirs).__name__}, "
                "whose forward may do more than a lookup; use a drafter checkpoint that includes its own embed_tokens."
            )
        if direct:
            ours.weight = theirs.weight  # the same Parameter: no second vocab matrix in memory
        elif name == "embed_tokens":
            setattr(drafter, name, TargetEmbeddingView(ours.own if isinstance(ours, TargetEmbeddingView) else ours,
                                                       theirs))
        else:
            setattr(drafter, name, TargetHeadView(theirs))
        shared.append(name)
    drafter.weights_from_target.difference_update(shared)
    drafter.shared_with_target.update(shared)
    return shared


def view_state_dict(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the target weights the drafter reaches through views (for saving them with the drafter)."""
    state = {}
    for name in ("embed_tokens", "lm_head"):
        view = getattr(drafter, name)
        if isinstance(view, (TargetEmbeddingView, TargetHeadView)):
            if is_quantized(view.target_module):
                raise ValueError(f"The target's {name} is quantized; it cannot be saved as the drafter's float weight.")
            with loaded_weight(view.target_module) as weight:
                state[f"{name}.weight"] = weight.detach().to("cpu", copy=True)
    return state
