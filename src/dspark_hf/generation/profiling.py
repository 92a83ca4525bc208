"""Where a round's time goes: `RoundProfiler` splits each round of the batched loop (the engine, batched
`generate()`) into prefill / draft backbone / Markov + sampling / scheduler / verify forward / verification /
bookkeeping.

Opt-in (`DSparkEngine(..., profile_rounds=True)`): every part boundary synchronises the device, so a profiled run is
slower than an unprofiled one and its parts add up to its own round time, not to an unprofiled run's.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn

from ..devices import synchronize

PARTS = ("prefill", "draft_backbone", "markov_sampling", "scheduler", "verify_forward", "verification", "bookkeeping")


class RoundProfiler:
    """Accumulates seconds per part over rounds; `report()` gives milliseconds per round.

    Parts: `prefill` (admitting new requests: their prompt forward and first token), `draft_backbone` (the drafter's
    one parallel forward), `markov_sampling` (the rest of drafting: the Markov loop, draft sampling, the confidence
    head), `scheduler` (each request's verify length), `verify_forward` (the target forward over every request's
    proposal), `verification` (acceptance and the emitted tokens), `bookkeeping` (everything else in the round: cache
    layout, committing tokens, stop checks).
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.seconds: Counter[str] = Counter()
        self.rounds = 0

    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Times the block as part `name`."""
        started = self._now()
        try:
            yield
        finally:
            self.seconds[name] += self._now() - started

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        """Times one whole round; what its parts do not cover becomes bookkeeping."""
        started = self._now()
        try:
            yield
        finally:
            self.seconds["round"] += self._now() - started
            self.rounds += 1

    @contextlib.contextmanager
    def drafting(self, drafter: nn.Module) -> Iterator[None]:
        """Times the block as drafting; each forward of `drafter` inside it (the backbone: `draft()` calls it once)
        counts as `draft_backbone`, the rest as `markov_sampling`."""
        started = []
        before = drafter.register_forward_pre_hook(lambda *unused: started.append(self._now()))
        after = drafter.register_forward_hook(
            lambda *unused: self.seconds.update(draft_backbone=self._now() - started.pop()))
        try:
            with self.part("draft"):
                yield
        finally:
            before.remove()
            after.remove()

    def report(self) -> dict[str, float]:
        """Milliseconds per round for each of `PARTS` and the whole `round` (zeros before the first round)."""
        rounds = max(1, self.rounds)
        ms = {name: 1e3 * self.seconds[name] / rounds for name in ("prefill", "draft_backbone", "scheduler",
                                                                     "verify_forward", "verification", "round")}
        ms["markov_sampling"] = 1e3 * (self.seconds["draft"] - self.seconds["draft_backbone"]) / rounds
        ms["bookkeeping"] = ms["round"] - sum(ms[name] for name in PARTS if name != "bookkeeping")
        return {name: ms[name] for name in (*PARTS, "round")}
