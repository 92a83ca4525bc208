"""What a target allows: whether a drafter fits it (the target's hidden states themselves are read by
`models.TargetLayerTap`) and whether its cache can be cut back after rejected drafts."""

from __future__ import annotations

from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..models import DSparkConfig, decoder_layers, layer_id_problems


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
    problems += layer_id_problems(drafter_config.target_layer_ids, num_layers)
    if drafter_config.mask_token_id is not None and not 0 <= drafter_config.mask_token_id < text.vocab_size:
        problems.append(f"mask_token_id {drafter_config.mask_token_id} is outside the vocabulary")
    if problems:
        raise ValueError(
            f"This DSpark drafter does not fit the target {type(target).__name__}: " + "; ".join(problems) + "."
        )
    decoder_layers(target)  # the taps hook these; a clear ValueError if the target has no `layers` list


def target_is_stateful(target: PreTrainedModel) -> bool:
    """Whether the target's cache cannot simply be cut back after rejected drafts (recurrent / Mamba / linear-attention
    layers, DeepSeek-V4's compressor layers): DSpark then decodes it with its copy-and-restore loop (`stateful.py`).

    transformers < 5.25 flags such models `_is_stateful` (an instance attribute set to True counts too); later releases
    drop the flag and let each cache layer say whether `crop` restores it (sliding-window and linear-attention layers
    can, once transformers' assisted loop has called `activate_past_recording`)."""
    flag = getattr(target, "_is_stateful", None)
    if flag is not None:
        return bool(flag)
    return not DynamicCache(config=target.config).is_croppable
