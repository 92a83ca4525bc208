"""Which target hidden states a drafter reads, how to ask transformers for them, and whether a drafter fits a target."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..models import DSparkConfig


def hidden_states_request(config: DSparkConfig) -> list[int] | bool:
    """The `output_hidden_states` value for the target's forward.

    A list captures only some layers, but its meaning changed within transformers 5.x: up to ~5.2x, entry i of the
    returned `num_layers`-tuple is the output of decoder layer i; later releases return the full `num_layers + 1`
    layout (embedding output first) with only the requested entries filled. Asking for both i and i + 1 covers
    either; `extract_target_features` tells them apart by the tuple's length. The embedding output (id -1) is only
    in the full tuple, so then ask for everything.
    """
    ids = list(config.target_layer_ids)
    return True if -1 in ids else sorted({i for layer in ids for i in (layer, layer + 1)})


def extract_target_features(
    hidden_states: tuple[torch.Tensor | None, ...], config: DSparkConfig, num_target_layers: int
) -> torch.Tensor:
    """Concatenates the drafter's target layers from a forward's `hidden_states` -> [B, T, K·H].

    Full tuples (`num_layers + 1` entries, the embedding output first) index layer i at i + 1; layer-list tuples
    (`num_layers` entries) index it at i.
    """
    shift = 1 if len(hidden_states) == num_target_layers + 1 else 0
    if shift == 0 and len(hidden_states) != num_target_layers:
        raise RuntimeError(
            f"The target returned {len(hidden_states)} hidden states for {num_target_layers} layers; cannot locate "
            f"target_layer_ids={list(config.target_layer_ids)}."
        )
    features = []
    for layer_id in config.target_layer_ids:
        state = hidden_states[layer_id + shift] if layer_id >= 0 or shift else None
        if state is None:
            raise RuntimeError(f"The target did not return the hidden state of layer {layer_id}.")
        features.append(state)
    return torch.cat(features, dim=-1)


def check_drafter_fits_target(drafter_config: DSparkConfig, target: PreTrainedModel) -> None:
    """Raises a `ValueError` naming the fix when the drafter cannot read this target."""
    text = target.config.get_text_config()
    num_layers = text.num_hidden_layers
    problems = []
    if drafter_config.vocab_size != text.vocab_size:
        problems.append(
            f"vocab size: drafter {drafter_config.vocab_size} vs target {text.vocab_size} (a drafter must be trained "
            "for the target's tokenizer)"
        )
    if drafter_config.hidden_size != text.hidden_size:
        problems.append(
            f"hidden size: the drafter reads target features of width {drafter_config.hidden_size} but the target's "
            f"hidden size is {text.hidden_size} (this drafter was trained for another target)"
        )
    if drafter_config.num_target_layers is not None and drafter_config.num_target_layers != num_layers:
        problems.append(
            f"layer count: the drafter was trained for a target with {drafter_config.num_target_layers} layers, "
            f"this target has {num_layers}"
        )
    for layer_id in drafter_config.target_layer_ids:
        if layer_id == num_layers - 1:
            problems.append(
                f"target_layer_ids contains {layer_id}, the target's last layer: transformers returns it after the "
                f"final norm, so its features differ from training; use layers -1..{num_layers - 2}"
            )
        elif not -1 <= layer_id < num_layers:
            problems.append(f"target_layer_ids contains {layer_id}, outside the target's layers -1..{num_layers - 2}")
    if drafter_config.mask_token_id is not None and not 0 <= drafter_config.mask_token_id < text.vocab_size:
        problems.append(f"mask_token_id {drafter_config.mask_token_id} is outside the vocabulary")
    if problems:
        raise ValueError(
            f"This DSpark drafter does not fit the target {type(target).__name__}: " + "; ".join(problems) + "."
        )
