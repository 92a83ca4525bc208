"""Train DSpark (and DFlash) drafters for any Hugging Face causal LM, online, on one GPU or many.

    from dspark_hf.training import TrainingConfig, preset, text_dataset, train_drafter
    config = preset("code50m-dspark")                      # or TrainingConfig(...), TrainingConfig.from_json(path)
    dataset = text_dataset(tokenizer, documents, config.max_length)   # or chat_dataset(...) after self_distill(...)
    train_drafter(target, tokenizer, dataset, config, "out/my-drafter")
    drafter = DSparkDraftModel.from_pretrained("out/my-drafter")      # then target.generate(..., assistant_model=drafter)

Scale out: `accelerate launch --num_processes N -m dspark_hf.training train ...` (same trainer, DDP).
"""

from .config import PRESETS, TrainingConfig, build_drafter_config, preset
from .data import (
    CHATML_TEMPLATE,
    TokenizedDataset,
    chat_dataset,
    collate,
    read_documents,
    read_jsonl,
    self_distill,
    text_dataset,
    tokenize_conversation,
)
from .features import FeatureCache, TargetFeatureExtractor, TargetFeatures, default_target_layer_ids
from .losses import LossWeights, acceptance_metrics, loss_terms, position_weights
from .masks import (
    AnchorBatch,
    block_mask_predicate,
    build_block_layout,
    dense_block_mask,
    flex_block_mask,
    sample_anchors,
)
from .objective import DraftObjective
from .trainer import DrafterTrainer, train_drafter

__all__ = [
    "CHATML_TEMPLATE",
    "PRESETS",
    "AnchorBatch",
    "DraftObjective",
    "DrafterTrainer",
    "FeatureCache",
    "LossWeights",
    "TargetFeatureExtractor",
    "TargetFeatures",
    "TokenizedDataset",
    "TrainingConfig",
    "acceptance_metrics",
    "block_mask_predicate",
    "build_block_layout",
    "build_drafter_config",
    "chat_dataset",
    "collate",
    "default_target_layer_ids",
    "dense_block_mask",
    "flex_block_mask",
    "loss_terms",
    "position_weights",
    "preset",
    "read_documents",
    "read_jsonl",
    "sample_anchors",
    "self_distill",
    "text_dataset",
    "tokenize_conversation",
    "train_drafter",
]
