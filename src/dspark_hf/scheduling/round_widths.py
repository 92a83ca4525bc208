"""`RoundWidthChooser`: how many drafts a round on static caches verifies, from measured round times.

On static caches (`DSparkEngine(static=True)`) every round runs all `max_batch_size` rows through a graph of fixed
shapes, so a round's cost depends only on how many drafts it verifies, v (v = 0: a plain round, no drafting), not on
how many requests are running or what they draft. The hardware-aware choice there is between a few such graphs:
each round, the v with the most expected committed tokens per second,

    (1 + S_1 + ... + S_v) / t(v),

where t(v) is the median of v's last measured round times and S_j the probability that a row accepts its first j
drafts, estimated from every verified draft of recent rounds (hazards h_j = P(draft j accepted | drafts < j were),
S_j = h_1 ... h_j; counts decay so that the estimate follows the text). A plain round commits one token per row.

Every width is measured first (`warmup` discarded rounds: a compiled round's first calls compile and capture, then
`samples`). After that, each other width is run again once `refresh_every` rounds have passed since it last ran, so
that neither its time nor the acceptance of drafts it would verify goes stale; every refresh that does not change
the choice doubles that width's interval (up to `max_refresh_every`), and a change of choice resets them all.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch


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
    """

    def __init__(self, widths: tuple[int, ...], warmup: int = 2, samples: int = 3, window: int = 9,
                 decay: float = 0.99, refresh_every: int = 32, max_refresh_every: int = 1024):
        if not widths or min(widths) < 0 or samples < 1 or window < samples or not 0 < decay <= 1 \
                or not 1 <= refresh_every <= max_refresh_every:
            raise ValueError("RoundWidthChooser needs widths >= 0, samples >= 1, window >= samples, 0 < decay <= 1 "
                             "and 1 <= refresh_every <= max_refresh_every.")
        self.widths = tuple(sorted(set(widths)))
        self.warmup, self.samples, self.decay = warmup, samples, decay
        self.refresh_every, self.max_refresh_every = refresh_every, max_refresh_every
        self._times = {width: deque(maxlen=window) for width in self.widths}
        self._runs = dict.fromkeys(self.widths, 0)
        self._last_run = dict.fromkeys(self.widths, 0)
        self._interval = dict.fromkeys(self.widths, refresh_every)
        self._best: int | None = None
        self._round = 0
        longest = max(self.widths)
        self._reached = torch.zeros(longest, dtype=torch.float64)  # drafts j verified with drafts < j accepted
        self._accepted = torch.zeros(longest, dtype=torch.float64)  # ... and accepted

    def survival(self) -> torch.Tensor:
        """[max width]: S_j, the estimated probability that a row accepts its first j drafts (j = 1..)."""
        hazards = torch.where(self._reached > 0, self._accepted / self._reached.clamp(min=1e-12),
                              torch.zeros_like(self._reached))
        return hazards.cumprod(dim=0)

    def expected_tokens(self, width: int) -> float:
        """Tokens a row is expected to commit in a round that verifies `width` drafts."""
        return 1.0 + float(self.survival()[:width].sum())

    def throughput(self, width: int) -> float | None:
        """Expected committed tokens per second and row for `width` (None: not measured yet)."""
        if len(self._times[width]) < self.samples:
            return None
        return self.expected_tokens(width) / statistics.median(self._times[width])

    def choose(self) -> int:
        """The number of drafts the next round verifies."""
        self._round += 1
        unmeasured = [width for width in self.widths if len(self._times[width]) < self.samples]
        if unmeasured:
            return unmeasured[0]
        best = max(self.widths, key=self.throughput)
        if best != self._best:
            self._best, self._interval = best, dict.fromkeys(self.widths, self.refresh_every)
        for width in self.widths:
            if width != best and self._round - self._last_run[width] >= self._interval[width]:
                self._interval[width] = min(2 * self._interval[width], self.max_refresh_every)
                return width
        return best

    def record(self, width: int, seconds: float, accepted: list[int]) -> None:
        """A finished round that verified `width` drafts: its wall-clock seconds and each running row's accepted
        drafts."""
        self._last_run[width] = self._round
        self._runs[width] += 1
        if self._runs[width] > self.warmup:
            self._times[width].append(seconds)
        if width == 0 or not accepted:
            return
        self._reached.mul_(self.decay)
        self._accepted.mul_(self.decay)
        counts = torch.tensor(accepted, dtype=torch.long).clamp(max=width)
        slots = torch.arange(width)
        reached = slots[None, :] <= counts[:, None]  # draft j + 1 was verified after j accepted (j < width)
        self._reached[:width] += reached.sum(dim=0).double()
        self._accepted[:width] += (slots[None, :] < counts[:, None]).sum(dim=0).double()

    def summary(self) -> dict[int, dict[str, float | None]]:
        """Per width: median round milliseconds, expected tokens per row, and tokens per second per row."""
        return {width: {"round_ms": 1e3 * statistics.median(times) if times else None,
                        "tokens_per_row": self.expected_tokens(width),
                        "tokens_per_second_per_row": self.throughput(width)}
                for width, times in self._times.items()}
