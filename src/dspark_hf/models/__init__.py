"""DSpark drafter models: configuration, backbone, heads."""

from .configuration import KNOWN_ARCHITECTURES, DSparkConfig
from .heads import ConfidenceHead, MarkovHead
from .modeling import DraftProposal, DSparkDraftModel, DSparkPreTrainedModel, TokenSelector, greedy_selector
from .taps import TargetLayerTap, check_layer_ids, decoder_layers, layer_id_problems
from .gemma4 import Gemma4DSparkDraftModel  # noqa: E402  (registers backbone "gemma4")
from .deepseek_v4 import DeepseekV4DSparkDraftModel  # noqa: E402  (registers backbone "deepseek_v4")

__all__ = [
    "KNOWN_ARCHITECTURES",
    "ConfidenceHead",
    "DSparkConfig",
    "DSparkDraftModel",
    "DSparkPreTrainedModel",
    "DeepseekV4DSparkDraftModel",
    "Gemma4DSparkDraftModel",
    "DraftProposal",
    "MarkovHead",
    "TargetLayerTap",
    "TokenSelector",
    "decoder_layers",
    "greedy_selector",
    "check_layer_ids",
    "layer_id_problems",
]
