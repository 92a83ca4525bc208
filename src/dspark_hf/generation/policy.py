"""Which verify-length policy a `generate()` call uses, from its arguments or the drafter's defaults.

Generation arguments (pass them to `generate()`, or set them on `drafter.generation_config` to make them the
drafter's defaults; `save_pretrained` keeps them):

- `dspark_policy`: `"fixed"` (verify every drafted token; the default), `"static_threshold"`, `"hardware_aware"`
  (Algorithm 1, synchronous, early stop) or `"hardware_aware_async"`;
- `dspark_threshold`: the conditional-confidence threshold of `"static_threshold"`;
- `dspark_sps_table`: an `SPSTable` (or a path to its JSON) for the hardware-aware policies;
- `dspark_gamma`: verify at most this many drafted tokens per round (an ablation of the block size γ at inference).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig

from ..calibration import apply_sts
from ..models import DSparkDraftModel
from ..scheduling import SchedulerPolicy, SPSTable, get_policy

GENERATION_ARGUMENTS = ("dspark_policy", "dspark_threshold", "dspark_sps_table", "dspark_gamma")


def register_generation_arguments() -> None:
    """Lets `generate(..., dspark_policy=...)` reach the generation config (transformers only accepts kwargs that
    are `GenerationConfig` attributes; class-level defaults of None make these such attributes)."""
    for name in GENERATION_ARGUMENTS:
        if not hasattr(GenerationConfig, name):
            setattr(GenerationConfig, name, None)


def _argument(name: str, generation_config: GenerationConfig, drafter: DSparkDraftModel):
    value = getattr(generation_config, name, None)
    if value is None and getattr(drafter, "generation_config", None) is not None:
        value = getattr(drafter.generation_config, name, None)
    return value


def resolve_policy(generation_config: GenerationConfig, drafter: DSparkDraftModel) -> SchedulerPolicy | None:
    """The policy for this call, or None for "verify every drafted token"."""
    name = _argument("dspark_policy", generation_config, drafter) or "fixed"
    if name in ("fixed", "fixed_length"):
        return None
    if drafter.confidence_head is None:
        raise ValueError(f"dspark_policy={name!r} needs a confidence head; this drafter (DFlash) has none. "
                         "Use dspark_policy='fixed'.")
    if name in ("static_threshold", "threshold"):
        threshold = _argument("dspark_threshold", generation_config, drafter)
        if threshold is None or not 0.0 <= float(threshold) <= 1.0:
            raise ValueError(f"dspark_policy='static_threshold' needs dspark_threshold in [0, 1], got {threshold}.")
        return get_policy(name, threshold=float(threshold))
    table = _argument("dspark_sps_table", generation_config, drafter)
    if isinstance(table, (str, Path)):
        table = SPSTable.load(table)
    if table is None and name in ("hardware_aware", "hardware_aware_sync", "hardware_aware_async", "async"):
        raise ValueError(f"dspark_policy={name!r} needs dspark_sps_table: profile the target once with "
                         "dspark_hf.scheduling.SPSTable.profile(target) and pass the table (or its JSON path).")
    return get_policy(name, sps_table=table)


def resolve_max_drafts(generation_config: GenerationConfig, drafter: DSparkDraftModel) -> int | None:
    """The `dspark_gamma` cap on verified drafts per round (None: the drafter's block)."""
    gamma = _argument("dspark_gamma", generation_config, drafter)
    if gamma is not None and not 1 <= int(gamma) <= drafter.config.num_draft_slots:
        raise ValueError(f"dspark_gamma must be between 1 and the drafter's {drafter.config.num_draft_slots} "
                         f"draft slots, got {gamma}.")
    return None if gamma is None else int(gamma)


class VerifyLengthChooser:
    """Applies a policy round by round at batch 1, keeping the confidences the asynchronous policy needs."""

    def __init__(self, policy: SchedulerPolicy | None, temperatures: list[float] | None,
                 max_drafts: int | None = None):
        self.policy = policy
        self.temperatures = temperatures
        self.max_drafts = max_drafts
        self.history: list[torch.Tensor] = []

    def __call__(self, confidence_logits: torch.Tensor | None, available: int) -> int:
        """How many of the `available` drafted tokens to verify."""
        if self.max_drafts is not None:
            available = min(available, self.max_drafts)
        if self.policy is None or confidence_logits is None or available == 0:
            return available
        conf = apply_sts(confidence_logits[:, :available].float(), self.temperatures)
        stale = self.history[-2] if len(self.history) >= 2 else None
        self.history = (self.history + [conf])[-2:]
        limit = torch.tensor([available], device=conf.device)
        return int(self.policy(conf, max_lengths=limit, conf_stale=stale)[0])
