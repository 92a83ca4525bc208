"""`SpeculationGuard`: should this round draft at all? Decided from measured round times, per batch size.

The hardware-aware policy picks each request's verify length from confidences and the SPS table, but only after the
drafter has run: the draft's own cost (and a verify forward that is no longer cheap at high load) can make a
speculative round slower per token than plain decoding. The guard measures that on the running engine and drafts
only while drafting pays.

The model: a plain round of R rows commits R tokens; a speculative round commits T tokens and costs κ plain rounds.
Drafting pays iff T / R > κ. Both are measured inside speculative rounds, per batch-size bucket (powers of two):

- κ is the round's wall time over what its verify part (target forward, verification, commit), measured after the
  drafts are known, would have cost with no drafts: V × SPS(verify tokens) / SPS(R) with the SPS table (V itself
  without one). Numerator and denominator come from the same round, so a host or device that runs faster or slower
  over time changes both alike. (Comparing rounds measured at different times does not survive that: the H200
  machine's virtual CPU runs the same Python up to 2x slower for seconds at a time, `host_phases_h200.json`.)
  The median of the last `window` values is used: it shrugs off one-off stalls and compilations.
- T / R is averaged over a longer window (`token_window` rounds): acceptance comes in bursts that follow the text,
  and a few rounds that accept nothing must not stop drafting for good.

The first speculative round after plain rounds also feeds the drafter every position those plain rounds committed
(its pending context); it is a switching cost, not the steady cost of drafting, so its κ is not recorded. While plain
rounds win, the guard probes every `probe_every` rounds with two speculative rounds (the second is measured). Once
`settle_samples` values of κ exist, a probe that confirms plain rounds doubles that bucket's interval (up to
`max_probe_every`); a probe in which drafting paid is repeated in the next round, so that a real change (or a first
measurement inflated by compilation) is confirmed within a few rounds.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque

from .sps import SPSTable


class SpeculationGuard:
    """Chooses between a speculative and a plain round from the measured cost of drafting, per batch-size bucket.

    Args:
        probe_every: rounds between two probes (speculative rounds while plain rounds win), after a change of winner.
        window: κ values (speculative round / equivalent plain round) kept per bucket; their median is used.
        max_probe_every: the longest interval; each probe that confirms plain rounds doubles the interval up to it.
        token_window: tokens-per-row values of speculative rounds kept per bucket; their mean is used.
        settle_samples: κ values needed before probes are spaced out.
        sps_table: the target's `SPSTable`, to scale a verify forward of many tokens to a plain one. `DSparkEngine`
            gives a guard without one its hardware-aware policy's table.
    """

    def __init__(self, probe_every: int = 16, window: int = 9, max_probe_every: int = 256, token_window: int = 64,
                 settle_samples: int = 8, sps_table: SPSTable | None = None):
        if probe_every < 2 or window < 1 or token_window < 1 or max_probe_every < probe_every:
            raise ValueError("SpeculationGuard needs probe_every >= 2, window >= 1, token_window >= 1 and "
                             "max_probe_every >= probe_every.")
        self.probe_every, self.max_probe_every, self.settle_samples = probe_every, max_probe_every, settle_samples
        self.sps_table = sps_table
        self._cost = defaultdict(lambda: deque(maxlen=window))  # κ per bucket
        self._tokens = defaultdict(lambda: deque(maxlen=token_window))  # tokens per row per bucket
        self._since_probe: dict[int, int] = defaultdict(int)
        self._interval: dict[int, int] = defaultdict(lambda: probe_every)
        self._probe_rounds: dict[int, int] = defaultdict(int)  # speculative rounds still owed to a probe
        self._winner: dict[int, bool] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def _pays(self, key: int) -> bool | None:
        """Whether a speculative round commits more tokens per plain round of time (None: not measured yet)."""
        if not self._cost[key] or not self._tokens[key]:
            return None
        return statistics.fmean(self._tokens[key]) > statistics.median(self._cost[key])

    def should_draft(self, batch_size: int) -> bool:
        """True: draft and verify this round; False: a plain decoding round."""
        key = self.bucket(batch_size)
        if self._probe_rounds[key]:
            self._probe_rounds[key] -= 1
            return True
        pays = self._pays(key)
        if pays is None:
            return True
        if self._winner.setdefault(key, pays) != pays:  # the last measurements changed the winner
            self._winner[key], self._interval[key], self._since_probe[key] = pays, self.probe_every, 0
        if pays:
            return True
        self._since_probe[key] += 1
        if self._since_probe[key] < self._interval[key]:
            return False
        self._since_probe[key] = 0
        if len(self._cost[key]) >= self.settle_samples:
            self._interval[key] = min(2 * self._interval[key], self.max_probe_every)
        self._probe_rounds[key] = 1  # this round catches the drafter up on the plain rounds, the next is measured
        return True

    def record(self, batch_size: int, seconds: float, verify_seconds: float, verify_tokens: int, tokens: int,
               catch_up: bool = False) -> None:
        """One finished speculative round of `batch_size` rows: its wall-clock seconds, the seconds of its verify
        part, the tokens that part's target forward processed, the tokens committed over all rows, and whether the
        drafter also caught up on plain rounds' positions in it (then only its tokens are recorded)."""
        if tokens <= 0 or batch_size <= 0:
            return
        key = self.bucket(batch_size)
        per_row = tokens / batch_size
        self._tokens[key].append(per_row)
        if catch_up or seconds <= 0 or verify_seconds <= 0:
            return
        plain_seconds = verify_seconds
        if self.sps_table is not None:  # time ∝ 1 / SPS: a forward of R tokens instead of verify_tokens
            plain_seconds *= self.sps_table(verify_tokens) / self.sps_table(batch_size)
        cost = seconds / plain_seconds
        self._cost[key].append(cost)
        if self._winner.get(key) is False and per_row > cost:  # a probe in which drafting paid: repeat it now
            self._probe_rounds[key], self._since_probe[key], self._interval[key] = 1, 0, self.probe_every

    def summary(self) -> dict[int, dict[str, float | bool | None]]:
        """Per bucket: the median cost of a speculative round in plain rounds (κ), the mean tokens per row it
        commits, and whether drafting pays (None where unmeasured)."""
        return {key: {"speculative_round_in_plain_rounds": statistics.median(self._cost[key])
                      if self._cost[key] else None,
                      "tokens_per_row": statistics.fmean(self._tokens[key]) if self._tokens[key] else None,
                      "drafting_pays": self._pays(key)}
                for key in sorted(set(self._cost) | set(self._tokens))}
