"""`SpeculationGuard`: should this round draft at all? Decided from measured round times, per batch size.

The hardware-aware policy picks each request's verify length from confidences and the SPS table, but only after the
drafter has run: the draft's own cost (and a verify forward that is no longer cheap at high load) can make a
speculative round slower per token than plain decoding. The guard measures both kinds of round on the running
engine and drafts only while drafting pays. Per batch-size bucket (powers of two) it keeps the last few measurements
of seconds per committed token for speculative and for plain rounds, compares their medians, and re-measures the
losing kind every `probe_every` rounds so that it follows load and sequence-length changes.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque


class SpeculationGuard:
    """Chooses between a speculative and a plain round from measured seconds per committed token.

    Args:
        probe_every: rounds between two measurements of the kind of round currently losing.
        window: measurements kept per (batch bucket, kind); their median is compared (robust to one-off stalls
            such as kernel compilation).
    """

    def __init__(self, probe_every: int = 16, window: int = 5):
        if probe_every < 2 or window < 1:
            raise ValueError("SpeculationGuard needs probe_every >= 2 and window >= 1.")
        self.probe_every, self.window = probe_every, window
        self._seconds_per_token = defaultdict(lambda: {True: deque(maxlen=window), False: deque(maxlen=window)})
        self._since_probe: dict[int, int] = defaultdict(int)

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
        self._since_probe[key] += 1
        if self._since_probe[key] >= self.probe_every:
            self._since_probe[key] = 0
            return not best
        return best

    def record(self, batch_size: int, drafted: bool, seconds: float, tokens: int) -> None:
        """One finished round: its kind, wall-clock seconds and tokens committed over all rows."""
        if tokens > 0:
            self._seconds_per_token[self.bucket(batch_size)][drafted].append(seconds / tokens)

    def summary(self) -> dict[int, dict[str, float | None]]:
        """Per bucket: median seconds per token of speculative and plain rounds (None where unmeasured)."""
        return {key: {("speculative" if kind else "plain"): (statistics.median(s) if s else None)
                      for kind, s in samples.items()} for key, samples in sorted(self._seconds_per_token.items())}
