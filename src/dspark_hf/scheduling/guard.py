"""`SpeculationGuard`: should this round draft at all? Decided from measured round times, per batch size.

The hardware-aware policy picks each request's verify length from confidences and the SPS table, but only after the
drafter has run: the draft's own cost (and a verify forward that is no longer cheap at high load) can make a
speculative round slower per token than plain decoding. The guard measures both kinds of round on the running
engine and drafts only while drafting pays. Per batch-size bucket (powers of two) and kind of round it estimates the
seconds per committed token as the median of the last few round times over the mean tokens committed per round in a
longer window: round times are a property of the hardware and load (a median shrugs off one-off stalls), while
acceptance comes in bursts that follow the text (a few rounds that accept nothing must not stop drafting for good).
It runs the cheaper kind and re-measures the other every `probe_every` rounds, so that it follows load and
sequence-length changes. Once the losing kind has `settle_samples` measurements, a probe that confirms the winner
doubles that bucket's interval (up to `max_probe_every`), so a settled decision costs ever fewer losing rounds; a
probe cheaper than the winner is repeated in the next round and resets the interval, so that a real change (or a
first measurement inflated by compilation) is corrected within a few rounds.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque


class SpeculationGuard:
    """Chooses between a speculative and a plain round from measured seconds per committed token.

    Args:
        probe_every: rounds between two measurements of the kind of round currently losing, after a change of
            winner.
        window: round times kept per (batch bucket, kind); their median is used.
        max_probe_every: the longest interval; each probe that confirms the winner doubles the interval up to it.
        token_window: committed-token counts kept per (batch bucket, kind); their mean is used.
        settle_samples: measurements of the losing kind needed before its probes are spaced out.
    """

    def __init__(self, probe_every: int = 16, window: int = 5, max_probe_every: int = 256, token_window: int = 64,
                 settle_samples: int = 8):
        if probe_every < 2 or window < 1 or token_window < 1 or max_probe_every < probe_every:
            raise ValueError("SpeculationGuard needs probe_every >= 2, window >= 1, token_window >= 1 and "
                             "max_probe_every >= probe_every.")
        self.probe_every, self.max_probe_every, self.settle_samples = probe_every, max_probe_every, settle_samples
        self._seconds = defaultdict(lambda: {True: deque(maxlen=window), False: deque(maxlen=window)})
        self._tokens = defaultdict(lambda: {True: deque(maxlen=token_window), False: deque(maxlen=token_window)})
        self._since_probe: dict[int, int] = defaultdict(int)
        self._interval: dict[int, int] = defaultdict(lambda: probe_every)
        self._winner: dict[int, bool] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def _cost(self, key: int, drafted: bool) -> float | None:
        """Estimated seconds per committed token of one kind of round in one bucket (None: not measured yet)."""
        seconds, tokens = self._seconds[key][drafted], self._tokens[key][drafted]
        return statistics.median(seconds) / statistics.fmean(tokens) if seconds else None

    def should_draft(self, batch_size: int) -> bool:
        """True: draft and verify this round; False: a plain decoding round."""
        key = self.bucket(batch_size)
        speculative, plain = self._cost(key, True), self._cost(key, False)
        if speculative is None:
            return True
        if plain is None:
            return False
        best = speculative <= plain
        if self._winner.setdefault(key, best) != best:  # the last probe (or a drift) changed the winner
            self._winner[key], self._interval[key] = best, self.probe_every
        self._since_probe[key] += 1
        if self._since_probe[key] >= self._interval[key]:
            self._since_probe[key] = 0
            if len(self._tokens[key][not best]) >= self.settle_samples:
                self._interval[key] = min(2 * self._interval[key], self.max_probe_every)
            return not best
        return best

    def record(self, batch_size: int, drafted: bool, seconds: float, tokens: int) -> None:
        """One finished round: its kind, wall-clock seconds and tokens committed over all rows."""
        if tokens <= 0:
            return
        key = self.bucket(batch_size)
        winner = self._winner.get(key)
        if winner is not None and drafted != winner:
            winner_cost = self._cost(key, winner)
            if winner_cost is not None and seconds / tokens < winner_cost:  # a probe beat the winner: repeat it now
                self._interval[key], self._since_probe[key] = self.probe_every, self.probe_every - 1
        self._seconds[key][drafted].append(seconds)
        self._tokens[key][drafted].append(tokens)

    def summary(self) -> dict[int, dict[str, float | None]]:
        """Per bucket: estimated seconds per committed token of speculative and plain rounds (None where
        unmeasured)."""
        return {key: {"speculative": self._cost(key, True), "plain": self._cost(key, False)}
                for key in sorted(self._seconds)}
