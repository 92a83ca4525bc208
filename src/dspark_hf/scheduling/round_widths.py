"""`RoundWidthChooser`: how many drafts a round on static caches verifies, from measured round times.

On static caches (`DSparkEngine(static=True)`) every round runs a fixed number of rows through a graph of fixed
shapes, so a round's cost depends only on that number and on how many drafts it verifies, v (v = 0: a plain round,
no drafting), not on what the requests draft. The hardware-aware choice there is between a few such graphs: each
round, the v with the most expected committed tokens per second,

    (1 + S_1 + ... + S_v) / t(v),

where t(v) is the median of v's last measured round times and S_j the probability that a row accepts its first j
drafts, estimated from every verified draft of recent rounds (hazards h_j = P(draft j accepted | drafts < j were),
S_j = h_1 ... h_j; counts decay so that the estimate follows the text). A plain round commits one token per row.

Round times are kept per number of rows the rounds run (`rows`: the engine runs the smallest power-of-two prefix of
its rows that holds every request), acceptance across them. Every width is measured first (`warmup` discarded rounds:
a compiled round's first calls compile and capture, then `samples`); a number of rows not yet measured at some width
borrows that width's time from the nearest one that is (the larger of two equally near), so that a batch draining
to fewer rows does not explore again. After that, each other width is run again once `refresh_every` rounds (at this
number of rows) have passed since it last ran there, so that neither its time nor the acceptance of drafts it
would verify goes stale; every refresh that does not change the choice doubles that width's interval (up to
`max_refresh_every`), and a change of choice resets them all. A refresh faster than every round time kept for its
width means those times are stale (e.g. measured while the machine was still warming up): they are dropped and the
width is timed again (`samples` rounds in a row) before the next choice that reads it; one refresh alone would take
half a window (a dozen) of doubling intervals to move the median. A width replaces the current choice only when its expected
rate is `switch_margin` higher: a change of choice on noise alone would restart the refreshes of every width. Once a
choice is made it stands for `decide_every` rounds (or until a refresh is due) without recomputing the rates: the engine
asks every round, and a round of a small model on a GPU lasts about a millisecond.
"""

from __future__ import annotations

import itertools
import math
import operator
import statistics
from collections import Counter, deque


class RoundWidthChooser:
    """Chooses each round's number of verified drafts among `widths` (0: a plain round).

    Args:
        widths: the candidate numbers of verified drafts, e.g. (0, 1, 3, 7).
        warmup: first rounds of each width not timed (compilation, graph capture).
        samples: timed rounds of each width before the choice is made on the measurements.
        window: round times kept per width; their median is used.
        decay: factor on the acceptance counts at every speculative round: 0.99 remembers about the last hundred.
        refresh_every: rounds after which a width that is not chosen is run again, after a change of choice.
        max_refresh_every: the longest such interval.
        switch_margin: how much more a width's expected rate must be than the current choice's to replace it: round
            times are noisy, and each change of choice restarts the refreshes.
        decide_every: rounds a choice stands before the rates are compared again (refreshes still run when due);
            the acceptance estimate remembers about 1 / (1 - decay) rounds, so a few rounds' delay changes little.
    """

    def __init__(self, widths: tuple[int, ...], warmup: int = 2, samples: int = 3, window: int = 25,
                 decay: float = 0.99, refresh_every: int = 32, max_refresh_every: int = 1024,
                 switch_margin: float = 0.02, decide_every: int = 8):
        if not widths or min(widths) < 0 or samples < 1 or window < samples or not 0 < decay <= 1 \
                or not 1 <= refresh_every <= max_refresh_every or switch_margin < 0 or decide_every < 1:
            raise ValueError("RoundWidthChooser needs widths >= 0, samples >= 1, window >= samples, 0 < decay <= 1, "
                             "1 <= refresh_every <= max_refresh_every, switch_margin >= 0 and decide_every >= 1.")
        self.widths = tuple(sorted(set(widths)))
        self.warmup, self.samples, self.decay = warmup, samples, decay
        self.refresh_every, self.max_refresh_every = refresh_every, max_refresh_every
        self.window = window
        self.switch_margin = switch_margin
        self.decide_every = decide_every
        self._buckets: dict[int, _WidthTimes] = {}
        # Plain Python floats: the engine asks every round, and a few dozen small torch operations on the host
        # cost about as much as a compiled round of a small model (~0.5 ms).
        longest = max(self.widths)
        self._reached = [0.0] * longest  # drafts j verified with drafts < j accepted
        self._accepted = [0.0] * longest  # ... and accepted
        self._expected: list[float] | None = None  # expected_tokens(v) for v = 0..longest, until the next record

    def survival(self) -> list[float]:
        """S_j for j = 1..max width: the estimated probability that a row accepts its first j drafts."""
        hazards = (accepted / reached if reached > 0 else 0.0 for reached, accepted in zip(self._reached,
                                                                                           self._accepted))
        return list(itertools.accumulate(hazards, operator.mul))

    def expected_tokens(self, width: int) -> float:
        """Tokens a row is expected to commit in a round that verifies `width` drafts."""
        if self._expected is None:
            self._expected = list(itertools.accumulate(self.survival(), initial=1.0))
        return self._expected[width]

    def _bucket(self, rows: int) -> _WidthTimes:
        if rows not in self._buckets:
            self._buckets[rows] = _WidthTimes(self.widths, self.window, self.refresh_every, self.samples)
        return self._buckets[rows]

    def throughput(self, width: int, rows: int = 0) -> float | None:
        """Expected committed tokens per second and row for `width` in rounds of `rows` rows; until those are
        measured, from the nearest number of rows where they are (None: nowhere yet)."""
        measured = [count for count, bucket in self._buckets.items() if bucket.median(width) is not None]
        if not measured:
            return None
        nearest = min(measured, key=lambda count: (abs(math.log2(max(count, 1) / max(rows, 1))), -count))
        return self.expected_tokens(width) / self._buckets[nearest].median(width)

    def choose(self, rows: int = 0) -> int:
        """The number of drafts the next round (of `rows` rows) verifies."""
        bucket = self._bucket(rows)
        bucket.rounds += 1
        if bucket.rounds < bucket.settled_until:
            return bucket.best
        medians = {width: bucket.median(width) for width in self.widths}
        rates = {width: self.expected_tokens(width) / median if median is not None else self.throughput(width, rows)
                 for width, median in medians.items()}  # (this number of rows' own times when it has them)
        unmeasured = [width for width, rate in rates.items() if rate is None]
        if unmeasured or bucket.retiming:
            return min(unmeasured or bucket.retiming)
        best = max(self.widths, key=rates.__getitem__)
        if bucket.best is not None and rates[best] < (1 + self.switch_margin) * rates[bucket.best]:
            best = bucket.best
        if best != bucket.best:
            bucket.best, bucket.interval = best, dict.fromkeys(self.widths, self.refresh_every)
        for width in self.widths:
            if width != best and bucket.rounds - bucket.last_run[width] >= bucket.interval[width]:
                bucket.interval[width] = min(2 * bucket.interval[width], self.max_refresh_every)
                return width
        due = min((bucket.last_run[width] + bucket.interval[width] for width in self.widths if width != best),
                  default=bucket.rounds + self.decide_every)
        bucket.settled_until = min(bucket.rounds + self.decide_every, due)
        return best

    def record(self, width: int, seconds: float, accepted: list[int], rows: int = 0) -> None:
        """A finished round of `rows` rows that verified `width` drafts: its wall-clock seconds and each running
        request's accepted drafts."""
        bucket = self._bucket(rows)
        bucket.last_run[width] = bucket.rounds
        bucket.runs[width] += 1
        if width != bucket.best:
            bucket.settled_until = 0  # (a refresh or a first measurement: decide again next round)
        if bucket.runs[width] > self.warmup:
            times = bucket.times[width]
            if width != bucket.best and len(times) >= self.samples and seconds < min(times):
                times.clear()  # a refresh faster than every kept time: they are stale, time this width again
                bucket.retiming.add(width)
            times.append(seconds)
            bucket.stale.add(width)
            if len(times) >= self.samples:
                bucket.retiming.discard(width)
        if width == 0 or not accepted:
            return
        self._reached = [count * self.decay for count in self._reached]
        self._accepted = [count * self.decay for count in self._accepted]
        rows_with = Counter(accepted)  # (the engine calls this every round: one pass over the rows, then per slot)
        at_least = len(accepted)  # rows that accepted >= slot drafts: draft slot + 1 was verified for them
        for slot in range(width):
            self._reached[slot] += at_least
            at_least -= rows_with[slot]
            self._accepted[slot] += at_least
        self._expected = None

    def summary(self) -> dict[int, dict[int, dict[str, float | None]]]:
        """Per number of rows, per width: median round milliseconds, expected tokens per row, and tokens per second
        per row."""
        return {rows: {width: {"round_ms": 1e3 * statistics.median(times) if times else None,
                               "tokens_per_row": self.expected_tokens(width),
                               "tokens_per_second_per_row": self.throughput(width, rows)}
                       for width, times in bucket.times.items()}
                for rows, bucket in sorted(self._buckets.items())}


class _WidthTimes:
    """One number of rows' round times per width, and the schedule of its refreshes."""

    def __init__(self, widths: tuple[int, ...], window: int, refresh_every: int, samples: int):
        self.times = {width: deque(maxlen=window) for width in widths}
        self.samples = samples
        self._medians: dict[int, float | None] = dict.fromkeys(widths)
        self.stale: set[int] = set()  # widths timed since their median was last taken
        self.runs = dict.fromkeys(widths, 0)
        self.last_run = dict.fromkeys(widths, 0)
        self.interval = dict.fromkeys(widths, refresh_every)
        self.best: int | None = None
        self.rounds = 0
        self.retiming: set[int] = set()  # widths whose stale times were dropped, timed again before the next choice
        self.settled_until = 0  # the round before which `best` stands without a new comparison

    def median(self, width: int) -> float | None:
        """The median of `width`'s kept round times, once they hold `samples` (None before)."""
        if width in self.stale:
            self.stale.discard(width)
            times = self.times[width]
            self._medians[width] = statistics.median(times) if len(times) >= self.samples else None
        return self._medians[width]
