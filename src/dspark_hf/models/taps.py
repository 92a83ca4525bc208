"""Reading a target's hidden states where a drafter taps them, with forward hooks on the target's decoder layers.

Tap i is the residual stream leaving decoder layer i (for DeepSeek-V4 all `hc_mult` hyper-connection streams,
`[B, T, hc_mult, H]`); tap -1 is the stream entering layer 0 (the embedding output). For every layer but the last this
is what transformers' `output_hidden_states` returns (it records the same decoder-layer outputs), but transformers
returns the last layer only after the final norm (V4: after `hc_head` and the norm), and the meaning of
`output_hidden_states=[ids]` changed within 5.x. Hooks read every layer raw, the same way on every version: generation
and training both read features through `TargetLayerTap`, so a drafter sees at inference exactly what it trained on.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's `num_hidden_layers` decoder layers (the text decoder's `layers` list)."""
    count = model.config.get_text_config().num_hidden_layers
    owners = [model]
    if hasattr(model, "get_decoder"):
        owners.insert(0, model.get_decoder())
    for owner in owners + [getattr(model, "base_model", model)]:
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) == count:
            return layers
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"Cannot find the {count} decoder layers of {type(model).__name__} (a `layers` ModuleList), so "
                     "its hidden states cannot be tapped for a DSpark drafter.")


def layer_id_problems(layer_ids, num_layers: int) -> list[str]:
    """What is wrong with tapping `layer_ids` on a target with `num_layers` layers (valid ids: -1..num_layers-1)."""
    return [f"target_layer_ids contains {i}, outside the target's layers -1..{num_layers - 1}"
            for i in layer_ids if not -1 <= i < num_layers]


def check_layer_ids(layer_ids, num_layers: int) -> None:
    """Raises a `ValueError` listing `layer_id_problems`, if any."""
    problems = layer_id_problems(layer_ids, num_layers)
    if problems:
        raise ValueError("; ".join(problems) + ".")


class TargetLayerTap:
    """Captures the target's tapped hidden states during its forwards; a context manager (hooks live inside `with`).
    Re-entrant: nested `with tap:` blocks keep the hooks until the outermost one ends.

    >>> with TargetLayerTap(target, [1, 3, 5]) as tap:
    ...     target(input_ids)
    ...     features = tap.features()  # [B, T, 3·H] (V4: [B, T, hc_mult, 3·H])
    """

    def __init__(self, model: nn.Module, layer_ids):
        self.layer_ids = list(layer_ids)
        self.layers = decoder_layers(model)
        check_layer_ids(self.layer_ids, len(self.layers))
        self._captured: dict[int, torch.Tensor] = {}
        self._handles: list = []
        self._depth = 0  # nested `with` blocks open

    def __enter__(self) -> TargetLayerTap:
        self._depth += 1
        if not self._handles:
            for layer_id in sorted(set(self.layer_ids)):
                if layer_id == -1:
                    handle = self.layers[0].register_forward_pre_hook(self._record_input, with_kwargs=True)
                else:
                    record = functools.partial(self._record_output, layer_id)
                    handle = self.layers[layer_id].register_forward_hook(record)
                self._handles.append(handle)
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._captured.clear()

    def _record_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._captured[-1] = args[0] if args else kwargs["hidden_states"]

    def _record_output(self, layer_id: int, module: nn.Module, args: tuple, output) -> None:
        self._captured[layer_id] = output[0] if isinstance(output, (tuple, list)) else output

    def features(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The last forward's tapped states, concatenated in `layer_ids` order on the last axis (on `device`, default
        the first tap's device); releases them, so each forward's features are read once."""
        missing = [i for i in self.layer_ids if i not in self._captured]
        if missing:
            raise RuntimeError(f"No hidden states captured for target layers {missing}: run the target's forward "
                               "inside `with tap:` before reading its features.")
        parts = [self._captured[i] for i in self.layer_ids]
        device = parts[0].device if device is None else device
        self._captured.clear()
        return torch.cat([part.to(device) for part in parts], dim=-1)
