"""`SpeculationGuard`: should this round draft at all? Decided from measured round times, per batch size.

The hardware-aware policy picks each request's verify length from confidences and the SPS table, but only after the
drafter has run: the draft's own cost (and a verify forward that is no longer cheap at high load) can make a
speculative round slower per token than plain decoding. The guard measures that on the running engine and drafts
only while drafting pays.

The model: a plain round of R rows commits R tokens; a speculative round commits T tokens and costs κ plain rounds.
Drafting pays iff T / R > κ. Everything is measured per batch-size bucket (powers of two), from the engine's rounds:

- A speculative round's time is compared with its own verify part (target forward, verification, commit, timed after
  the drafts are known), scaled to a forward of R tokens with the SPS table: E = V × SPS(verify tokens) / SPS(R).
  Both come from the same round, so a host or device that runs faster or slower over time changes both alike. (The
  H200 machine's virtual CPU runs the same Python up to 2x slower for seconds at a time, `host_phases_h200.json`.)
- E is not quite a plain round: the verification of drafts, the wider cache and the SPS table's own error make a
  plain round ρ × E. ρ is measured from pairs of adjacent rounds, a plain one next to a speculative one (adjacent
  rounds run in the same speed phase): ρ = plain round seconds / E. Then κ = (round seconds / E) / ρ. Where drafting
  wins by too little for an error in ρ not to matter (T / R < 1.3 κ) and no pair is recent, one plain round is run
  every `calibrate_every` speculative rounds to measure ρ; where drafting clearly wins, none is.
- κ (raw) and ρ are medians of the last `window` values: they shrug off one-off stalls and compilations. T / R is
  averaged over a longer window (`token_window` rounds): acceptance comes in bursts that follow the text, and a few
  rounds that accept nothing must not stop drafting for good.

The first speculative round after plain rounds also feeds the drafter every position those plain rounds committed
(its pending context): its cost is a switching cost, kept apart (κ_switch) from the steady κ. While plain rounds
win, the guard probes with two speculative rounds (the second is measured). A probe loses (κ_switch − T/R) + (κ −
T/R) plain rounds of time; once `settle_samples` values of κ exist, probes are spaced so that they cost at most
`probe_share` of the time (at least `probe_every` and at most `max_probe_every` rounds apart): rarely where drafting
loses by far, often near break-even, where they cost little. A probe in which drafting paid is repeated in the next
round, so that a real change (or a first measurement inflated by compilation) is confirmed within a few rounds.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque

from .sps import SPSTable


class SpeculationGuard:
    """Chooses between a speculative and a plain round from the measured cost of drafting, per batch-size bucket.

    Args:
        probe_every: rounds between two probes (speculative rounds while plain rounds win) at least.
        window: κ, κ_switch and ρ values kept per bucket; their medians are used.
        max_probe_every: rounds between two probes at most.
        token_window: tokens-per-row values of speculative rounds kept per bucket; their mean is used.
        settle_samples: κ values needed before probes are spaced by what they cost.
        probe_share: the share of time probes may lose where plain rounds win.
        calibrate_every: near break-even, speculative rounds between two measurements of ρ (one plain round each).
        sps_table: the target's `SPSTable`, to scale a verify forward of many tokens to a plain one. `DSparkEngine`
            gives a guard without one its hardware-aware policy's table.
    """

    CLOSE = 1.3  # T / R within this factor of κ: an error in ρ could flip the decision

    def __init__(self, probe_every: int = 16, window: int = 9, max_probe_every: int = 256, token_window: int = 64,
                 settle_samples: int = 8, probe_share: float = 0.02, calibrate_every: int = 32,
                 sps_table: SPSTable | None = None):
        if (probe_every < 2 or window < 1 or token_window < 1 or max_probe_every < probe_every
                or not 0 < probe_share < 1 or calibrate_every < 1):
            raise ValueError("SpeculationGuard needs probe_every >= 2, window >= 1, token_window >= 1, "
                             "max_probe_every >= probe_every, 0 < probe_share < 1 and calibrate_every >= 1.")
        self.probe_every, self.max_probe_every, self.settle_samples = probe_every, max_probe_every, settle_samples
        self.probe_share, self.calibrate_every = probe_share, calibrate_every
        self.sps_table = sps_table
        samples = lambda size: defaultdict(lambda: deque(maxlen=size))  # noqa: E731
        self._cost, self._switch_cost, self._plain_ratio = samples(window), samples(window), samples(window)
        self._tokens = samples(token_window)  # tokens per row per bucket
        self._since_probe: dict[int, int] = defaultdict(int)
        self._since_ratio: dict[int, int] = defaultdict(int)  # speculative rounds since the last ρ value
        self._probe_rounds: dict[int, int] = defaultdict(int)  # speculative rounds still owed to a probe
        self._winner: dict[int, bool] = {}
        self._last: tuple[str, int, float] | None = None  # the last round reported: kind, bucket, seconds or E

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def _ratio(self, key: int) -> float:
        """ρ: a plain round's seconds over a speculative round's verify part scaled to R tokens (1 until measured)."""
        return statistics.median(self._plain_ratio[key]) if self._plain_ratio[key] else 1.0

    def _kappa(self, key: int, switch: bool = False) -> float | None:
        """The cost of a speculative round in plain rounds (the first after plain rounds with `switch`)."""
        costs = self._switch_cost[key] if switch and self._switch_cost[key] else self._cost[key]
        return statistics.median(costs) / self._ratio(key) if costs else None

    def _pays(self, key: int) -> bool | None:
        """Whether a speculative round commits more tokens per plain round of time (None: not measured yet)."""
        if not self._cost[key] or not self._tokens[key]:
            return None
        return statistics.fmean(self._tokens[key]) > self._kappa(key)

    def _probe_interval(self, key: int) -> int:
        """Rounds between probes: what one probe loses, over `probe_share`, within [probe_every, max_probe_every]."""
        if len(self._cost[key]) < self.settle_samples:
            return self.probe_every
        tokens = statistics.fmean(self._tokens[key])
        loss = max(0.0, self._kappa(key, switch=True) - tokens) + max(0.0, self._kappa(key) - tokens)
        return min(self.max_probe_every, max(self.probe_every, math.ceil(loss / self.probe_share)))

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
            self._winner[key], self._since_probe[key] = pays, 0
        if pays:
            self._since_ratio[key] += 1
            close = statistics.fmean(self._tokens[key]) < self.CLOSE * self._kappa(key)
            if close and self._since_ratio[key] > self.calibrate_every:  # one plain round: measure ρ
                self._since_ratio[key] = 0
                return False
            return True
        self._since_probe[key] += 1
        if self._since_probe[key] < self._probe_interval(key):
            return False
        self._since_probe[key] = 0
        self._probe_rounds[key] = 1  # this round catches the drafter up on the plain rounds, the next is measured
        return True

    def _pair(self, key: int, kind: str, value: float) -> None:
        """Takes one ρ value from this round and the previous one if they are a plain and a speculative round of
        one bucket; remembers this round."""
        last = self._last
        if last is not None and last[1] == key and last[0] != kind and value > 0 and last[2] > 0:
            plain, verify_part = (value, last[2]) if kind == "plain" else (last[2], value)
            self._plain_ratio[key].append(plain / verify_part)
            self._since_ratio[key] = 0
        self._last = (kind, key, value)

    def record_plain(self, batch_size: int, seconds: float) -> None:
        """One finished plain round of `batch_size` rows and its wall-clock seconds."""
        if batch_size > 0:
            self._pair(self.bucket(batch_size), "plain", seconds)

    def record(self, batch_size: int, seconds: float, verify_seconds: float, verify_tokens: int, tokens: int,
               catch_up: bool = False) -> None:
        """One finished speculative round of `batch_size` rows: its wall-clock seconds, the seconds of its verify
        part, the tokens that part's target forward processed, the tokens committed over all rows, and whether the
        drafter also caught up on plain rounds' positions in it (its cost then counts as a switching cost)."""
        if tokens <= 0 or batch_size <= 0:
            return
        key = self.bucket(batch_size)
        per_row = tokens / batch_size
        self._tokens[key].append(per_row)
        if seconds <= 0 or verify_seconds <= 0:
            return
        verify_part = verify_seconds
        if self.sps_table is not None:  # time ∝ 1 / SPS: a forward of R tokens instead of verify_tokens
            verify_part *= self.sps_table(verify_tokens) / self.sps_table(batch_size)
        self._pair(key, "speculative", verify_part)
        (self._switch_cost if catch_up else self._cost)[key].append(seconds / verify_part)
        cost = seconds / verify_part / self._ratio(key)
        if not catch_up and self._winner.get(key) is False and per_row > cost:  # a probe that paid: repeat it now
            self._probe_rounds[key], self._since_probe[key] = 1, 0

    def summary(self) -> dict[int, dict[str, float | bool | None]]:
        """Per bucket: the median cost of a speculative round in plain rounds (κ; of the first after plain rounds),
        ρ, the mean tokens per row a speculative round commits, whether drafting pays (None where unmeasured) and
        the current probe interval."""
        keys = sorted(set(self._cost) | set(self._tokens) | set(self._plain_ratio))
        return {key: {"speculative_round_in_plain_rounds": self._kappa(key),
                      "switching_round_in_plain_rounds": self._kappa(key, switch=True),
                      "plain_round_over_verify_part": self._ratio(key) if self._plain_ratio[key] else None,
                      "tokens_per_row": statistics.fmean(self._tokens[key]) if self._tokens[key] else None,
                      "drafting_pays": self._pays(key), "probe_interval": self._probe_interval(key)
                      if self._cost[key] and self._tokens[key] else None}
                for key in keys}
