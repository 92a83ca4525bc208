"""`SpeculationGuard`: should this round draft at all? Decided from measured round times, per batch size.

The hardware-aware policy picks each request's verify length from confidences and the SPS table, but only after the
drafter has run: the draft's own cost (and a verify forward that is no longer cheap at high load) can make a
speculative round slower per token than plain decoding. The guard measures both kinds of round on the running
engine and drafts only while drafting pays. Per batch-size bucket (powers of two) it keeps the last few measurements
of seconds per committed token for speculative and for plain rounds, compares their medians, and re-measures the
losing kind every `probe_every` rounds so that it follows load and sequence-length changes. A probe that confirms the
winner doubles that bucket's interval (up to `max_probe_every`), so a settled decision costs ever fewer losing
rounds; a probe faster than the winner's median resets it, so that a real change is confirmed within a few rounds.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque


class SpeculationGuard:
    """Chooses between a speculative and a plain round from measured seconds per committed token.

    Args:
        probe_every: rounds between two measurements of the kind of round currently losing, after a change of
            winner.
        max_probe_every: the longest interval; each probe that confirms the winner doubles the interval up to it.
        window: measurements kept per (batch bucket, kind); their median is compared (robust to one-off stalls
            such as kernel compilation).
    """

    def __init__(self, probe_every: int = 16, window: int = 5, max_probe_every: int = 256):
        if probe_every < 2 or window < 1 or max_probe_every < probe_every:
            raise ValueError("SpeculationGuard needs probe_every >= 2, window >= 1 and max_probe_every >= probe_every.")
        self.probe_every, self.window, self.max_probe_every = probe_every, window, max_probe_every
        self._seconds_per_token = defaultdict(lambda: {True: deque(maxlen=window), False: deque(maxlen=window)})
        self._since_probe: dict[int, int] = defaultdict(int)
        self._interval: dict[int, int] = defaultdict(lambda: probe_every)
        self._winner: dict[int, bool] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def should_draft(self, batch_size: int) -> bool:
        """True: draft and verify this round; False: a plain decoding round."""
        key = self.bucket(batch_size)
        samples = self._seconds_per_token[key]
        if not samples[True]:
            return True
        if not samples[False]:
            return False
        best = statistics.median(samples[True]) <= statistics.median(samples[False])
        if self._winner.setdefault(key, best) != best:  # the last probe (or a drift) changed the winner
            self._winner[key], self._interval[key] = best, self.probe_every
        self._since_probe[key] += 1
        if self._since_probe[key] >= self._interval[key]:
            self._since_probe[key] = 0
            self._interval[key] = min(2 * self._interval[key], self.max_probe_every)
            return not best
        return best

    def record(self, batch_size: int, drafted: bool, seconds: float, tokens: int) -> None:
        """One finished round: its kind, wall-clock seconds and tokens committed over all rows."""
        if tokens <= 0:
            return
        key = self.bucket(batch_size)
        samples, winner = self._seconds_per_token[key], self._winner.get(key)
        if winner is not None and drafted != winner and samples[winner]:
            if seconds / tokens < statistics.median(samples[winner]):  # a probe beat the winner: look again soon
                self._interval[key] = self.probe_every
        samples[drafted].append(seconds / tokens)

    def summary(self) -> dict[int, dict[str, float | None]]:
        """Per bucket: median seconds per token of speculative and plain rounds (None where unmeasured)."""
        return {key: {("speculative" if kind else "plain"): (statistics.median(s) if s else None)
                      for kind, s in samples.items()} for key, samples in sorted(self._seconds_per_token.items())}
