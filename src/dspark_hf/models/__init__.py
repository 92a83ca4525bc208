"""DSpark drafter models: configuration, backbone, heads."""

from .configuration import KNOWN_ARCHITECTURES, DSparkConfig
from .heads import ConfidenceHead, MarkovHead
from .modeling import DraftProposal, DSparkDraftModel, DSparkPreTrainedModel, TokenSelector, greedy_selector

__all__ = [
    "KNOWN_ARCHITECTURES",
    "ConfidenceHead",
    "DSparkConfig",
    "DSparkDraftModel",
    "DSparkPreTrainedModel",
    "DraftProposal",
    "MarkovHead",
    "TokenSelector",
    "greedy_selector",
]
