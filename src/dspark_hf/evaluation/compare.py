"""Plain `generate()` and DSpark `generate()` on the same input, timed in one run."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..attention_backends import decoding_attention
from ..devices import synchronize
from ..generation import DSparkStats
from ..models import DSparkDraftModel


@dataclass
class Comparison:
    """One prompt decoded both ways. Token counts exclude the prompt."""

    plain_ids: torch.LongTensor
    dspark_ids: torch.LongTensor
    plain_seconds: float
    dspark_seconds: float
    stats: DSparkStats
    prompt_length: int

    @property
    def identical(self) -> bool:
        return torch.equal(self.plain_ids, self.dspark_ids)

    @property
    def plain_tokens_per_second(self) -> float:
        return (self.plain_ids.shape[1] - self.prompt_length) / self.plain_seconds

    @property
    def dspark_tokens_per_second(self) -> float:
        return (self.dspark_ids.shape[1] - self.prompt_length) / self.dspark_seconds

    @property
    def speedup(self) -> float:
        return self.dspark_tokens_per_second / self.plain_tokens_per_second


def timed_generate(target: PreTrainedModel, input_ids: torch.LongTensor, **generate_kwargs):
    """`target.generate(input_ids, **generate_kwargs)` without gradients; returns (output, wall-clock seconds),
    synchronising the device around the call so the time covers the whole generation."""
    synchronize(target.device)
    started = time.perf_counter()
    with torch.no_grad(), decoding_attention():  # plain and DSpark runs use the same attention kernels
        output = target.generate(input_ids, **generate_kwargs)
    synchronize(target.device)
    return output, time.perf_counter() - started


def compare_generation(
    target: PreTrainedModel,
    drafter: DSparkDraftModel,
    input_ids: torch.LongTensor,
    streamer_factory=None,
    **generate_kwargs,
) -> Comparison:
    """Runs plain and DSpark generation with the same arguments and seed; returns both outputs and timings.

    `streamer_factory(kind)` (optional) returns a streamer for "plain" / "dspark".
    """
    results = {}
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    for kind, extra in (("plain", {}), ("dspark", {"assistant_model": drafter})):
        streamer = streamer_factory(kind) if streamer_factory else None
        torch.manual_seed(seed)
        results[kind] = timed_generate(target, input_ids, streamer=streamer, **extra, **generate_kwargs)
    return Comparison(
        plain_ids=results["plain"][0],
        dspark_ids=results["dspark"][0],
        plain_seconds=results["plain"][1],
        dspark_seconds=results["dspark"][1],
        stats=drafter.generation_stats,
        prompt_length=input_ids.shape[1],
    )
