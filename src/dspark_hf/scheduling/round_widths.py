"""`RoundWidthChooser`: how many drafts a round on static caches verifies, from measured round times.

On static caches (`DSparkEngine(static=True)`) every round runs a fixed number of rows through a graph of fixed
shapes, so a round's cost depends only on that number and on how many drafts it verifies, v (v = 0: a plain round,
no drafting), not on what the requests draft. The hardware-aware choice there is between a few such graphs: each
round, the v with the most expected committed tokens per second,

    (1 + S_1 + ... + S_v) / t(v),

where t(v) is v's round time (the engine times a round whole, until its tokens are delivered: the host's work on them
costs every round alike, and leaving it out undervalued the wider widths) plus the overhead of the server's step around
a round (`record`'s `overhead`: before the round and after the delivery, 0.14-0.23 ms a round on an H100 at c = 64-128
against rounds of 0.6-1.6 ms; mostly freeing finished requests' rows, then 0.12 ms in a round where any finished; every
width's, so its mean over the group's last `window` rounds, the expected cost of a round: at c = 4, where few rounds
free rows, a width whose measuring rounds did would otherwise look 20 % slower, and the median would count it in every
round at c = 64 or in none at c = 4), and S_j the probability that a row accepts its first j drafts, estimated from
every verified draft of recent rounds (hazards h_j = P(draft j accepted | drafts < j were), each its posterior mean on a
uniform prior, S_j = h_1 ... h_j). A plain round commits one token per row. The counts of a draft slot decay (by
`decay`, 0.999: about the last thousand rounds) only in rounds that verify it; a slot beyond the chosen width keeps what
the other widths' rounds told, and one nobody verified counts as 1/2, not 0 (at c = 1, when unverified counts decayed
and hazards were taken as accepted / reached, the choice could stick below the best width for good). The memory is long
on purpose: on real text a few requests' good or bad stretch moves the estimate, and by the time it has the requests
have changed. With 0.99 and posterior draws in every comparison (the chooser until 2026-12-05), the GPU's code50m cells
at c = 2-16 split their rounds between γ = 3 and γ = 7 where γ = 3 led by 1.6-2.8 %; `benchmarks/chooser_on_text.py`
reproduces that on the CPU. A width that looks better replaces the choice only if it leads by `switch_margin` in at
least `switch_confidence` of `draws` joint draws of the hazards from their Beta posteriors (`confidence`): a lead
resting on a few lucky rows is not enough. The counts are per round, and a wider round strides through easy text in
fewer rounds: γ = 7's rounds put γ = 3's tokens per round 4 % low on code50m's text, and with γ = 3 chosen, γ = 7's
refresh rounds (which start where γ = 3's rounds did) put γ = 7's about 2 % high, so the chooser leaned to γ = 7 from
either side (on an H100 at c = 4 it estimated 1.765 and 1.936 tokens a round where fixed γ = 3 and 7 committed 1.82
and 1.91, ran γ = 7 and served 0.96 x fixed γ = 3). With `strides=True` a width at most as wide as the one the rows
walked at lately takes its tokens per round from the strides of that width's rounds as the choice (`_stride_tokens`: a
row that committed T tokens in one round covered the text of ceil(T / (v + 1)) rounds of v drafts); wider widths still
take the hazards (their upward lean remains). Off by default: beside the hazards alone on one H100 at c = 4 (two calls)
it served 0.964 and 0.977 x fixed γ = 3 where the hazards alone served 0.996 and 0.992, though through the rounds
below (`record`'s `refined`), not through the strides themselves.

Acceptance also runs in stretches: on code50m's text, a row that accepted all 7 drafts of a round accepted 6 of the next
round's on average, one that accepted none 0.57 (`chooser_on_text.py`'s fixed γ = 7 rounds at c = 4). So the counts are
also kept per acceptance state of the rows before the round (`acceptance_state`: the drafts it accepted in its last
round, whether that was all of them, or AFTER_PLAIN), and `refine` picks each round's width from the states of the rows
it runs, with each state's expected tokens (`state_tokens`: its own counts, `state_prior` verified drafts added at the
average row's hazards, or at the state's own hazard of the slot before where that is higher). `choose` keeps the rest:
which widths to measure, confirm or refresh, their times, and the width a round of average rows would take. The rows are
counted per state, and `refine`'s table rebuilt, every `state_every` rounds (`prepare`, while the device runs a round):
the engine asks every round, and a small model's round lasts about half a millisecond. Only rounds of at most
`state_rows` rows are refined: with more, the states average out and the estimates per state are less sure than the
average. On the CPU twin of the H100's code50m cells (`chooser_on_text.py`), c = 1 served 1.018 x fixed γ = 3, the best
fixed width (1.000 without `refine`), c = 2 1.012 (1.000); refining every round, c = 4 served 0.994 (0.997-1.001
without) and c = 16 0.99 x (docs/serving_measurements.md): hence `state_rows` = 2.

Round times drift: on the H200 machine every width's rounds slowed by a fifth within a few seconds, while a width
that is not chosen runs only now and then. So only the chosen width's time is kept as such (the median of its last
`reference_rounds` rounds); every other width's rounds are kept as their log time minus the log of that median when
they ran, i.e. relative to the choice as it ran around them. t(v) above is the chosen width's time times v's relative
cost (the exponential of the median of its last `window` relative log times). When the choice changes, every kept
value is re-expressed relative to the new choice. A round right after a round of another width also costs more (on an
H100 the chosen width's round after a refresh took 1-2.3 % longer than its steady rounds): every refresh pays that,
the chosen width's steady rounds never do, so unless it is taken out the others lean against them. The chosen width's
rounds right after another width's are kept apart (`after_switch`, not in its reference), and the median of the last
`window` of them, relative to the reference (`switch_cost`), is taken off the time of every round of another width
that followed a round of a different width.

A round's tokens also bring admissions about: a request that finishes makes room for the next, whose prefill runs
between rounds. Per committed token that costs every drafting width the same, but after a long run of plain rounds
requests join without their prompts' drafter context (`StaticRows`), which a drafting round's requests need: on an
H100 at c = 128 a drafting engine's admission took 0.22 ms a request against plain decoding's 0.20, and admissions
took a third of the serving time, so plain decoding served 1.055 x fixed γ = 3 where the rounds alone put them within
2 %. So a plain round's cost is lessened by `requests` x its tokens x `admission_saving`: what a committed token
saves, the difference of `admission_per_token` (a request's admission seconds of each kind, from `record_admission`:
the mean over the last `window` admissions; for plain rounds, until some requests joined without the context,
`admission_ratio` x the other kind's, which `StaticRows.warm_up` sets from the two admission graphs' times; over the
tokens a request commits before it leaves, from `record_finished`: the mean of the last `window` departures, so that
a serving benchmark's warm-up run of short requests is soon forgotten). Only the difference: the whole admission cost
in every width's rate would shrink the leads between drafting widths and with them what `switch_margin` asks (on the
CPU twin at c = 4, where admissions took a sixth of the time, 3 of 16 seeds then kept γ = 7 for thousands of rounds).
Without admissions (the CPU twins without `--admission-ms`) it is 0.

Times are kept per group of rounds (`group`): the number of rows the rounds run (the engine runs the smallest prefix of
its rows in its graph sizes that holds every request) and, up to a power of two, how many of them hold a request, since
the host's work on a round's tokens grows with the requests (on an H100 at c = 64, the last rounds of a run, 1-23
requests in the 64-row graph, timed plain at 0.45-0.48 ms against 0.57 with 64 requests; kept with the full rounds'
times, they put plain's expected rate at 1.2 x γ = 3's, and the engine ran plain rounds where fixed γ = 3 served 1.09 x
as much). Acceptance is counted across groups. Every width is measured first (`warmup` discarded rounds: a compiled
round's first calls compile and capture, then `samples`; a round whose graph was captured beforehand, e.g. by
`DSparkEngine.warm_up()`, is timed from the first), the widths in turn (one round each, then again), so that every width
is timed under the same conditions (on an H100 at c = 64 and 128, one width after another, plain's first rounds ran
faster and γ = 3's slower than later in the run, and plain was chosen where γ = 3 served more); a group not yet measured
at some width borrows that width's cost from the nearest one that is (the same number of rows first; the larger of two
equally near), so that a batch draining to fewer requests does not explore again. After that, each other width is run
again once its wait has passed since it last ran there, so that neither its time nor the acceptance of drafts it would
verify goes stale. The wait is `refresh_every` rounds (in this group), doubled by every refresh that does not change the
choice (up to `max_refresh_every`; a change of choice resets them all). From the second refresh after a change of choice
on, the wait is stretched by 1 + gap / `refresh_gap` for a width whose expected rate is a fraction `gap` below the
choice's: a refresh costs about gap of a round, so each width's refreshes cost at most about refresh_gap / wait of the
rounds, however far behind it is (the first refresh comes unstretched, since the width's times may be stale). A refresh
faster than every time kept for its width means those times are stale (e.g. measured while the machine was still warming
up): if at the refresh's time the width would reach the choice's expected rate, they are dropped and the width is timed
again (`samples` rounds in a row) before the next choice that reads it; otherwise the refresh is kept as one more time
(retiming a width that would still trail cost the Qwen3-4B shape 6 rounds of γ = 1 at c = 16). A width that looks better
than the current choice is first timed afresh (its kept times dropped, `samples` rounds in a row), and replaces the
choice only if its expected rate is then still `switch_margin` higher: a change of choice on noise or on old times alone
would restart the refreshes of every width. Once a choice is made it stands for `decide_every` rounds (or until a
refresh is due) without recomputing the rates: the engine asks every round, and a round of a small model on a GPU lasts
about a millisecond.
"""

from __future__ import annotations

import itertools
import math
import operator
import random
import statistics
from collections import Counter, deque
from collections.abc import Sequence

# A row's acceptance state, what the chooser conditions its acceptance on (`acceptance_state`): before its first
# drafting round and after a plain round, AFTER_PLAIN; after a drafting round, the drafts it accepted, or FULL + the
# round's width if it accepted all of them (the count then only a lower bound).
AFTER_PLAIN = -1
FULL = 16
# the reasons of `RoundWidthChooser.choose` whose width `refine` may change (the others measure, confirm or refresh one)
REFINED = ("settled", "keep", "switch")
# the reasons of `choose` whose width only probes (the choice stays what it was): such a round does not end a run of
# plain rounds (`StaticRows` admits requests without their prompt's drafter context in a long one)
PROBES = ("measure", "confirm", "refresh")
STRIDE_ROWS = 32.0  # the (decayed) rows a width's rounds must have counted before `_stride_tokens` reads them


def acceptance_state(width: int, accepted: int) -> int:
    """A row's state after a round that verified `width` drafts, of which it accepted `accepted` (width 0: a plain
    round)."""
    return AFTER_PLAIN if width == 0 else accepted if accepted < width else FULL + width


class RoundWidthChooser:
    """Chooses each round's number of verified drafts among `widths` (0: a plain round).

    Args:
        widths: the candidate numbers of verified drafts, e.g. (0, 1, 3, 7).
        warmup: first rounds of each width not timed (compilation, graph capture), unless `record` is told that the
            round's graph was captured beforehand.
        samples: timed rounds of each width before the choice is made on the measurements.
        window: relative round times kept per width; their median is used.
        decay: factor on a draft slot's acceptance counts at every round that verifies it: 0.999 remembers about
            the last thousand.
        refresh_every: rounds after which a width that is not chosen is run again, after a change of choice.
        max_refresh_every: the longest such wait.
        refresh_gap: a width whose expected rate is a fraction gap below the choice's waits 1 + gap / refresh_gap
            times as long.
        switch_margin: how much more a width's expected rate must be than the current choice's to replace it: round
            times are noisy, and each change of choice restarts the refreshes.
        decide_every: rounds a choice stands before the rates are compared again (refreshes still run when due);
            the acceptance estimate remembers about 1 / (1 - decay) rounds, so a few rounds' delay changes little.
        reference_rounds: the chosen width's last rounds whose median is its time, and the reference of the others.
        switch_confidence: the share of posterior draws in which a width must lead by `switch_margin` to replace
            the choice.
        draws: the number of those draws.
        seed: seeds those draws.
        state_prior: the weight, in verified drafts, of a state's prior (the acceptance of all rows, or the
            state's own of the slot before where higher) in its estimate (`state_tokens`).
        state_rows: `refine` changes the width of rounds of at most this many rows (0: never); the engine counts the
            rows' states only in such rounds.
        state_every: rounds between updates of the per-state counts and of `refine`'s table (`prepare`): the engine
            asks every round, and a state's estimate, like the average row's, remembers about a thousand rounds.
        strides: a width at most as wide as the one run lately takes its tokens per round from that width's rounds
            by their strides (`_stride_tokens`: acceptance runs in stretches, as on real text); False (the default,
            see the module docstring): from the hazards alone (right where a round's acceptance is independent of
            the round before).
    """

    def __init__(self, widths: tuple[int, ...], warmup: int = 2, samples: int = 3, window: int = 25,
                 decay: float = 0.999, refresh_every: int = 32, max_refresh_every: int = 1024,
                 refresh_gap: float = 0.05, switch_margin: float = 0.02, decide_every: int = 8,
                 reference_rounds: int = 9, switch_confidence: float = 0.9, draws: int = 32, seed: int = 0,
                 state_prior: float = 4.0, state_rows: int = 2, state_every: int = 32, strides: bool = False):
        if not widths or min(widths) < 0 or samples < 1 or window < samples or not 0 < decay <= 1 \
                or not 1 <= refresh_every <= max_refresh_every or refresh_gap <= 0 or switch_margin < 0 \
                or decide_every < 1 or reference_rounds < 1 or not 0 < switch_confidence < 1 or draws < 1 \
                or state_prior <= 0 or state_rows < 0 or state_every < 1:
            raise ValueError("RoundWidthChooser needs widths >= 0, samples >= 1, window >= samples, 0 < decay <= 1, "
                             "1 <= refresh_every <= max_refresh_every, refresh_gap > 0, switch_margin >= 0, "
                             "decide_every >= 1, reference_rounds >= 1, 0 < switch_confidence < 1, draws >= 1, "
                             "state_prior > 0, state_rows >= 0 and state_every >= 1.")
        self.widths = tuple(sorted(set(widths)))
        self.warmup, self.samples, self.decay = warmup, samples, decay
        self.refresh_every, self.max_refresh_every, self.refresh_gap = refresh_every, max_refresh_every, refresh_gap
        self.window = window
        self.switch_margin = switch_margin
        self.decide_every = decide_every
        self.reference_rounds = reference_rounds
        self._buckets: dict[int, _WidthTimes] = {}
        # Plain Python floats: the engine asks every round, and a few dozen small torch operations on the host
        # cost about as much as a compiled round of a small model (~0.5 ms).
        longest = max(self.widths)
        self._reached = [0.0] * longest  # drafts j verified with drafts < j accepted
        self._accepted = [0.0] * longest  # ... and accepted
        self._expected: list[float] | None = None  # expected_tokens(v) for v = 0..longest, until the next record
        # per drafting width x, from its rounds as the choice (all decayed at each such round of any width): the rows'
        # committed tokens, and for each width v <= x the rounds of width v that would have committed them
        self._stride_committed = dict.fromkeys(self.widths, 0.0)
        self._stride_rounds = {width: [0.0] * (width + 1) for width in self.widths}
        # the same counts per acceptance state of the rows before the round; the rows not counted in them yet, per
        # (state, width, accepted drafts) (`_fold_states`); state_tokens(state) until the next record
        self._state_counts: dict[int, tuple[list[float], list[float]]] = {}
        self._unfolded: dict[tuple[int, int, int], int] = {}
        self._state_expected: dict[int, list[float]] = {}
        self._state_rates: tuple | None = None  # `prepare`'s (group, each width's seconds, each state's rates)
        # `refine`'s answers (its width, the rates compared) per (drafting round, the rows' states) until `prepare`
        # builds its table again: a round of few rows waits for it between its synchronisation and its launch
        self._refined: dict[tuple[int, ...], tuple[int, dict[int, float]]] = {}
        self._records_since_prepared = 0
        self._last_width: int | None = None  # the last recorded round's width
        # admissions (`record_admission`): per kind (with the prompts' drafter context: True; without: False) the
        # last `window` admissions' (seconds, requests); the last `window` departures' (tokens, requests)
        # (`record_finished`)
        self._admissions: dict[bool, deque[tuple[float, int]]] = {True: deque(maxlen=window),
                                                                  False: deque(maxlen=window)}
        self._finished: deque[tuple[int, int]] = deque(maxlen=window)
        self._request_seconds: dict[bool, float | None] = {}  # `_seconds_per_request`, until the next admission
        self._tokens_per_request: float | None = None  # of the kept departures, until the next one
        # a request's admission without the drafter's context over one with it, until both are measured
        # (`StaticRows.warm_up` times the two admission graphs; 1: no saving assumed)
        self.admission_ratio = 1.0
        self.state_prior, self.state_rows, self.state_every = state_prior, state_rows, state_every
        self.strides = strides
        self.switch_confidence, self.draws = switch_confidence, draws
        self._rng = random.Random(seed)
        # why the last `choose` returned its width, and the expected rates (tokens per second and row) it compared,
        # if it compared any: the engine's round log keeps them (`DSparkEngine.round_log` "choice")
        self.reason: str | None = None
        self.rates: dict[int, float] | None = None

    def survival(self) -> list[float]:
        """S_j for j = 1..max width: the estimated probability that a row accepts its first j drafts (each hazard its
        posterior mean: the decayed counts on a uniform prior)."""
        hazards = ((accepted + 1) / (reached + 2) for reached, accepted in zip(self._reached, self._accepted))
        return list(itertools.accumulate(hazards, operator.mul))

    def expected_tokens(self, width: int) -> float:
        """Tokens a row is expected to commit in a round that verifies `width` drafts: `_stride_tokens` up to the width
        run lately, else from the hazards (`survival`)."""
        if self._expected is None:
            hazards = list(itertools.accumulate(self.survival(), initial=1.0))
            strides = self._stride_tokens()
            self._expected = hazards if strides is None else strides + hazards[len(strides):]
        return self._expected[width]

    def _stride_tokens(self) -> list[float] | None:
        """Tokens per row and round that each width v = 0..x would commit in its own rounds, from the rounds of the
        width x the rows walked at lately (the most counted; None: fewer than `STRIDE_ROWS` rows), counted while x
        was the choice: a row's round of x drafts that committed T tokens covers the text of ceil(T / (v + 1)) rounds
        of v drafts (taking the text past an accepted draft to be as easy for the next round), so the estimate is the
        committed tokens over those rounds. The per-slot hazards count each round alike instead, and a wider round
        strides through easy text in fewer rounds: on code50m's acceptance field
        (`benchmarks/results/acceptance_field_code50m_cpu.json`, rows walked at one width), γ = 7's rounds put γ = 3's
        tokens per round at 1.754 from the hazards and 1.812 from the strides, where γ = 3's own rounds commit 1.823.
        Another width's refresh rounds start where the choice's rounds did, not where its own would, so they are not
        counted here."""
        if not self.strides:
            return None
        walked = max(self.widths, key=lambda x: self._stride_rounds[x][x])  # (the choice of late)
        if self._stride_rounds[walked][walked] < STRIDE_ROWS:
            return None
        committed = self._stride_committed[walked]
        return [committed / rounds for rounds in self._stride_rounds[walked]]

    def state_tokens(self, state: int) -> list[float]:
        """Tokens a row in acceptance `state` (`acceptance_state`) is expected to commit in a round that verifies
        v = 0..max width drafts. Each hazard is the state's counts with `state_prior` verified drafts added at the
        larger of the hazard of all rows (its posterior mean) and the state's own hazard of the slot before: a state's
        slot seldom verified takes the rows' average, or, where the state's rows accept more, their own rate (acceptance
        runs in stretches). Without the latter a width wider than the choice was never tried where it pays: on an H100
        at c = 1 with γ = 3 chosen, the rows' drafts 4-7 were seldom verified (only by refreshes, 4 rounds a run) and
        estimated at about a fifth, so rows that had just accepted all 3 drafts expected little more from 7, though
        fixed γ = 7's rounds after such a round accepted 2.87 drafts on average (1.69 of the first 3)."""
        if self._unfolded:
            self._fold_states()
        expected = self._state_expected.get(state)
        if expected is None:
            prior = self.state_prior
            hazards = [(accepted + 1) / (reached + 2) for reached, accepted in zip(self._reached, self._accepted)]
            if state in self._state_counts:
                own = 0.0  # (the state's hazard of the slot before)
                for slot, (pooled, count, kept) in enumerate(zip(hazards, *self._state_counts[state])):
                    own = hazards[slot] = (kept + prior * max(pooled, own)) / (count + prior)
            survival = itertools.accumulate(hazards, operator.mul)
            expected = self._state_expected[state] = list(itertools.accumulate(survival, initial=1.0))
        return expected

    def refine(self, width: int, states: Sequence[int], rows: int = 0) -> int:
        """The next round's width, given the one `choose` returned and the acceptance state (`acceptance_state` of
        their last round) of each of the round's rows: the width with the most expected tokens per second for these
        rows. A row that just accepted all its drafts tends to accept many again, one that accepted none few, so the
        best width changes from round to round; `choose` compares widths on the average row. A drafting round stays a
        drafting one: after a round that accepted nothing, a plain round and a narrow one expect about as many tokens
        per second, and on an H100 the hardware-aware engine's plain rounds cost 6-9 % more than no speculation's
        (they keep the drafter's context), more than its own estimate of them (on the CPU twin at c = 1, turning such
        rounds plain served 1.020 x the best fixed width with the plain rounds' true time, 1.009 x with a plain round
        8 % dearer than the chooser expected; never turning them, 1.012 x either way). A width returned to measure,
        confirm or refresh one stands, and so does the width of a round of more than `state_rows` rows (their states
        average out, and the estimates per state are less sure than the average: on the CPU twin of the GPU's cells,
        refining rounds of 4 rows served 0.994 x the best fixed width, rounds of 16 0.99 x). `reason` becomes "state"
        where the rows' states change the choice. (The engine calls this between a round's end and the next one's
        start, where the device waits: it reads the table `prepare` built during the round before.)"""
        if self.reason not in REFINED or len(states) > self.state_rows:
            return width
        self.prepare(rows, len(states))  # (done already, in the engine)
        if self._state_rates is None:  # (a width without a time: see `prepare`)
            return width
        drafting = width != 0 and self.widths[0] == 0  # (a drafting round stays one)
        key = (drafting, *states)
        refined = self._refined.get(key)
        if refined is None:
            _, seconds, table = self._state_rates
            rates, known = None, True
            for state in states:
                row_rates = table.get(state)
                if row_rates is None:  # (a state first seen since the table was built)
                    row_rates, known = self._state_rates_of(state, seconds), False
                rates = row_rates if rates is None else [total + rate for total, rate in zip(rates, row_rates)]
            best = max(range(int(drafting), len(self.widths)), key=rates.__getitem__)
            refined = (self.widths[best], dict(zip(self.widths, rates)))
            if known:  # (the same until the table is rebuilt)
                self._refined[key] = refined
        if refined[0] != width:
            self.reason, self.rates = "state", refined[1]
        return refined[0]

    def prepare(self, rows: int = 0, requests: int | None = None) -> None:
        """Computes, for `refine` in rounds of `rows` rows holding `requests` requests (None: all), every state's
        expected tokens per second at each width, once every `state_every` rounds: the engine calls it while the
        device runs a round, after `choose`, and most calls return at once. (Nothing to do when `choose` returned a
        width to measure, confirm or refresh: not every width's time may be known then. A settled choice may also
        stand while a width has no time anywhere: a refresh in another group found its times stale and times it
        again; then `refine` keeps the choice until it has one.)"""
        group = self.group(rows, requests)
        if self.reason not in REFINED or (self._state_rates is not None and self._state_rates[0] == group
                                          and self._records_since_prepared < self.state_every):
            return
        self._records_since_prepared = 0
        self._refined.clear()
        self._fold_states()
        seconds = [self._cost(width, group, requests) for width in self.widths]
        if None in seconds:
            self._state_rates = None
            return
        self._state_rates = (group, seconds, {state: self._state_rates_of(state, seconds)
                                              for state in (AFTER_PLAIN, *self._state_counts)})

    def _state_rates_of(self, state: int, seconds: list[float]) -> list[float]:
        tokens = self.state_tokens(state)
        return [tokens[width] / time for width, time in zip(self.widths, seconds)]

    def _rates(self, times: dict[int, float], requests: int = 1) -> dict[int, float]:
        """Each width's expected tokens per second and row, its rounds (of `requests` requests) taking `times`, less
        what its tokens' admissions save (`admission_saving`)."""
        return {width: self._rate(self.expected_tokens(width), seconds, requests * self.admission_saving(width))
                for width, seconds in times.items()}

    @classmethod
    def _rate(cls, tokens: float, seconds: float, saving: float) -> float:
        """Tokens per second and row of rounds that take `seconds` and commit `tokens` a row, each token saving
        `saving` seconds of admissions."""
        return tokens / cls._saved_seconds(seconds, tokens, saving)

    @staticmethod
    def _saved_seconds(seconds: float, tokens: float, saving: float) -> float:
        """A round's `seconds` less what its `tokens` a row save of admissions, `saving` a token (at most half)."""
        return max(seconds - tokens * saving, seconds / 2)

    def confidence(self, challenger: int, incumbent: int, times: dict[int, float], requests: int = 1) -> float:
        """The share of `draws` joint draws of the hazards from their Beta posteriors in which `challenger`'s rate
        beats `incumbent`'s by `switch_margin` (rounds of `requests` requests taking `times`)."""
        wins = 0
        pooled = list(itertools.accumulate(self.survival(), initial=1.0))
        scale = {width: self.expected_tokens(width) / pooled[width] for width in (challenger, incumbent)}
        saving = {width: requests * self.admission_saving(width) for width in (challenger, incumbent)}
        for _ in range(self.draws):  # (each draw's tokens scaled as `_stride_tokens` corrects the hazards' estimate)
            hazards = (self._rng.betavariate(accepted + 1, reached - accepted + 1)
                       for reached, accepted in zip(self._reached, self._accepted))
            tokens = list(itertools.accumulate(itertools.accumulate(hazards, operator.mul), initial=1.0))
            rate = {width: self._rate(scale[width] * tokens[width], times[width], saving[width])
                    for width in (challenger, incumbent)}
            wins += rate[challenger] > (1 + self.switch_margin) * rate[incumbent]
        return wins / self.draws

    def record_admission(self, seconds: float, requests: int, prompt_context: bool = True) -> None:
        """An admission of `requests` requests that took `seconds` (prefill and first tokens, until the host has
        them), `prompt_context`: with their prompts' drafter context (False: the engine was in a long run of plain
        rounds, `StaticRows`)."""
        if requests > 0:
            self._admissions[prompt_context].append((seconds, requests))
            self._request_seconds.pop(prompt_context, None)

    def record_finished(self, tokens: int, requests: int = 1) -> None:
        """`requests` requests left their rows (finished or cancelled), having committed `tokens` tokens in all: each
        makes room for an admission."""
        if requests > 0:
            self._finished.append((tokens, requests))
            self._tokens_per_request = None

    def admission_per_token(self, width: int) -> float:
        """The admission seconds a committed token brings about in rounds of `width`: a request's admission seconds,
        with the drafter's context or without it (for plain rounds, as in a long run of them: measured, else
        `admission_ratio` × with it), over the tokens a request commits before it leaves (the mean of the last `window`
        departures). 0 before any admission or before a request left."""
        if not self._finished:
            return 0.0
        seconds = self._seconds_per_request(width != 0)
        if seconds is None:  # (only the other kind measured so far)
            seconds = self._seconds_per_request(width == 0)
            if seconds is None:
                return 0.0
            seconds *= self.admission_ratio if width == 0 else 1 / self.admission_ratio
        if self._tokens_per_request is None:
            self._tokens_per_request = self._per_request(self._finished)
        return seconds / max(self._tokens_per_request, 1.0)

    def admission_saving(self, width: int) -> float:
        """The admission seconds a committed token of `width` saves against a drafting width's
        (`admission_per_token`): 0 for every drafting width, whose admissions cost alike; for plain rounds what
        requests that join without their prompts' drafter context save (only the difference: see the module
        docstring)."""
        if width != 0 or max(self.widths) == 0:
            return 0.0
        return max(0.0, self.admission_per_token(max(self.widths)) - self.admission_per_token(0))

    def _seconds_per_request(self, prompt_context: bool) -> float | None:
        """The mean admission seconds of a request of the last `window` admissions of one kind (None: none yet)."""
        if prompt_context not in self._request_seconds:
            self._request_seconds[prompt_context] = self._per_request(self._admissions[prompt_context])
        return self._request_seconds[prompt_context]

    @staticmethod
    def _per_request(kept: deque[tuple[float, int]]) -> float | None:
        """The mean per request of (amount, requests) pairs: the amounts' sum over the requests' (None: none kept)."""
        return sum(amount for amount, _ in kept) / sum(requests for _, requests in kept) if kept else None

    @staticmethod
    def group(rows: int, requests: int | None = None) -> tuple[int, int]:
        """The round times' group of a round of `rows` rows, `requests` of which hold a request (None: all): the
        rows, and the smallest power of two at least the requests (at most the rows)."""
        return rows, rows if requests is None else min(rows, 1 << max(0, requests - 1).bit_length())

    def _bucket(self, group: tuple[int, int]) -> _WidthTimes:
        if group not in self._buckets:
            self._buckets[group] = _WidthTimes(self.widths, self.window, self.refresh_every, self.samples,
                                               self.reference_rounds)
        return self._buckets[group]

    def _seconds(self, width: int, group: tuple[int, int]) -> float | None:
        """`width`'s current round time in `group`; until it is measured there, from the nearest group where it is
        (the same number of rows first, then the nearest number of requests; None: nowhere yet)."""
        own = self._buckets[group].seconds(width) if group in self._buckets else None
        if own is not None:
            return own
        measured = [other for other, bucket in self._buckets.items() if bucket.seconds(width) is not None]
        if not measured:
            return None

        def distance(other: tuple[int, int]) -> tuple[float, float, int, int]:
            (rows, requests), (other_rows, other_requests) = group, other
            return (abs(math.log2(max(other_rows, 1) / max(rows, 1))),
                    abs(math.log2(max(other_requests, 1) / max(requests, 1))), -other_rows, -other_requests)
        return self._buckets[min(measured, key=distance)].seconds(width)

    def _cost(self, width: int, group: tuple[int, int], requests: int | None = None) -> float | None:
        """`width`'s seconds a round in `group` of `requests` requests (None: the group's rows): its round time
        (`_seconds`) and the server's step around a round (`record`'s `overhead`, every width's; 0 where none was
        told), less what its rows' expected tokens save of admissions (`admission_saving`). None: not measured yet."""
        seconds = self._seconds(width, group)
        if seconds is None:
            return None
        requests = group[0] if requests is None else requests
        return self._saved_seconds(seconds + (self._buckets[group].overhead() if group in self._buckets else 0.0),
                                   self.expected_tokens(width), requests * self.admission_saving(width))

    def throughput(self, width: int, rows: int = 0, requests: int | None = None) -> float | None:
        """Expected committed tokens per second and row for `width` in rounds of `rows` rows holding `requests`
        requests (None: all; None returned: not measured yet)."""
        cost = self._cost(width, self.group(rows, requests), requests)
        return None if cost is None else self.expected_tokens(width) / cost

    def choose(self, rows: int = 0, requests: int | None = None) -> int:
        """The number of drafts the next round (of `rows` rows, `requests` of them holding a request; None: all)
        verifies. `reason` tells why: "settled" (the choice stands), "measure" (a width not measured yet, or timed
        afresh), "confirm" (a width that looks better, timed afresh first), "switch" (it replaces the choice), "keep"
        (the comparison kept the choice) or "refresh" (a width not chosen, run again); `rates` holds the compared
        rates, if this call compared them."""
        group = self.group(rows, requests)
        bucket = self._bucket(group)
        bucket.rounds += 1
        self.rates = None
        if bucket.rounds < bucket.settled_until:
            self.reason = "settled"
            return bucket.best
        times = {width: self._seconds(width, group) for width in self.widths}
        unmeasured = [width for width, seconds in times.items() if seconds is None]
        if unmeasured or bucket.retiming:
            self.reason = "measure"
            if not unmeasured:
                return min(bucket.retiming)
            width = min(unmeasured, key=lambda width: (bucket.measure_turns[width], width))  # (in turn)
            bucket.measure_turns[width] += 1
            return width
        overhead = bucket.overhead()
        costs = {width: seconds + overhead for width, seconds in times.items()}
        requests = rows if requests is None else requests
        self.rates = rates = self._rates(costs, requests)
        best = max(self.widths, key=rates.__getitem__)
        if bucket.best is not None and best != bucket.best and (
                rates[best] < (1 + self.switch_margin) * rates[bucket.best]
                or self.confidence(best, bucket.best, costs, requests) < self.switch_confidence):
            best = bucket.best
        if best != bucket.best and bucket.best is not None and bucket.confirming != best:
            bucket.confirming = best  # time it afresh (`samples` rounds in a row) before it replaces the choice
            bucket.relative[best].clear()
            bucket.stale.add(best)
            bucket.retiming.add(best)
            self.reason = "confirm"
            return best
        bucket.confirming = None
        self.reason = "keep"
        if best != bucket.best:
            bucket.choose(best, times[best])
            bucket.interval = dict.fromkeys(self.widths, self.refresh_every)
            self.reason = "switch"
        due = {}
        for width in self.widths:
            if width != best:
                wait = bucket.interval[width]
                if wait > self.refresh_every:  # (the first refresh after a change checks the width's old times)
                    gap = max(0.0, 1.0 - rates[width] / rates[best])
                    wait = min(wait * (1 + gap / self.refresh_gap), self.max_refresh_every)
                due[width] = bucket.last_run[width] + wait
                if bucket.rounds >= due[width]:
                    bucket.interval[width] = min(2 * bucket.interval[width], self.max_refresh_every)
                    self.reason = "refresh"
                    return width
        bucket.settled_until = min([bucket.rounds + self.decide_every, *due.values()])  # (due: empty for one width)
        return best

    def record(self, width: int, seconds: float, accepted: list[int], rows: int = 0, captured: bool = False,
               states: list[int] | None = None, requests: int | None = None, overhead: float | None = None,
               refined: bool = False) -> None:
        """A finished round of `rows` rows that verified `width` drafts: its wall-clock seconds and each running
        request's accepted drafts. `captured`: the round replayed a graph captured before (timed even among the
        first `warmup` rounds). `states`: each row's acceptance state before the round (`acceptance_state`), for
        `state_tokens`. `requests`: the rows that held a request (None: all). `overhead`: the seconds the server's
        step spent around the round (before it, after its tokens were delivered; see the module docstring).
        `refined`: `refine` chose the width for these rows' states, so their acceptance counts for their states
        only, not for the average row: rows that had just accepted every draft, given 7 drafts, made the average
        row's drafts 4-7 (verified in few other rounds) look likelier than they are. On an H100 at c = 4 that fed
        back (more such rounds, then γ = 7 as the choice, where fixed γ = 3 served 4 % more)."""
        group = self.group(rows, requests)
        bucket = self._bucket(group)
        if overhead is not None:
            bucket.add_overhead(overhead)
        bucket.last_run[width] = bucket.rounds
        bucket.runs[width] += 1
        self._records_since_prepared += 1
        after_other, self._last_width = self._last_width not in (None, width), width
        if width != bucket.best:
            bucket.settled_until = 0  # (a refresh or a first measurement: decide again next round)
        if captured or bucket.runs[width] > self.warmup:
            log_seconds = math.log(seconds)
            if width != bucket.best and after_other:
                log_seconds -= bucket.switch_cost()
            bucket.add(width, log_seconds, after_other,
                       may_retime=width == bucket.best or self._could_lead(width, math.exp(log_seconds), group,
                                                                          requests))
        if width == 0 or not accepted:
            return
        if not refined:
            rows_with = Counter(accepted)
            self._count(width, rows_with, len(accepted), self._reached, self._accepted)
            if self.strides and width == bucket.best:  # (another width's rounds start where the choice's did)
                self._count_strides(width, rows_with)
            self._expected = None
        self._state_expected.clear()  # (each state's prior is the average row's)
        if states is not None:  # (counted per state at the next `prepare` or `state_tokens`: most rounds read none)
            unfolded = self._unfolded
            for state, count in zip(states, accepted):
                key = (state, width, count)
                unfolded[key] = unfolded.get(key, 0) + 1

    def _fold_states(self) -> None:
        """Adds the rows recorded since the last fold to their states' counts. A state's draft slot decays by `decay`
        for each of those rows whose round verified it (per row, where the average row's counts decay per round;
        within one fold, every row counts alike)."""
        longest, decay = max(self.widths), self.decay
        verified: dict[int, list[int]] = {}  # per state, per draft slot: the rows that verified it
        for (state, width, _), rows in self._unfolded.items():
            slots = verified.setdefault(state, [0] * longest)
            for slot in range(width):
                slots[slot] += rows
        for state, slots in verified.items():
            if state not in self._state_counts:
                self._state_counts[state] = ([0.0] * longest, [0.0] * longest)
            for counts in self._state_counts[state]:
                counts[:] = [count * decay ** rows for count, rows in zip(counts, slots)]
        for (state, width, count), rows in self._unfolded.items():
            reached, accepted_counts = self._state_counts[state]
            for slot in range(min(count + 1, width)):  # (a row that accepted `count` drafts verified draft count + 1)
                reached[slot] += rows
            for slot in range(min(count, width)):
                accepted_counts[slot] += rows
        self._unfolded.clear()
        self._state_expected.clear()

    def _count(self, width: int, rows_with: dict[int, int], rows: int, reached: list[float],
               accepted_counts: list[float]) -> None:
        """Adds a round's `rows` rows, `rows_with[k]` of which accepted k drafts, to the counts of its `width` draft
        slots, decayed first (the engine calls `record` every round: the rows are counted in one pass, then the
        slots in another; a row that accepted at least `slot` drafts had draft slot + 1 verified)."""
        decay, at_least = self.decay, rows
        for slot in range(width):
            reached[slot] = reached[slot] * decay + at_least
            at_least -= rows_with.get(slot, 0)
            accepted_counts[slot] = accepted_counts[slot] * decay + at_least

    def _count_strides(self, width: int, rows_with: dict[int, int]) -> None:
        """Adds a round of `width` drafts whose rows accepted k drafts `rows_with[k]` times to `_stride_tokens`'
        counts of `width`; every width's counts decay first (so the choice of late holds the most)."""
        decay = self.decay
        for counted in self.widths:
            self._stride_committed[counted] *= decay
            self._stride_rounds[counted] = [rounds * decay for rounds in self._stride_rounds[counted]]
        rows = rows_with.items()
        self._stride_committed[width] += sum((accepted + 1) * count for accepted, count in rows)
        rounds = self._stride_rounds[width]
        for narrower in range(width + 1):  # (ceil((accepted + 1) / (narrower + 1)) rounds per row)
            rounds[narrower] += sum(-(-(accepted + 1) // (narrower + 1)) * count for accepted, count in rows)

    def _could_lead(self, width: int, seconds: float, group: tuple[int, int], requests: int | None = None) -> bool:
        """Whether `width`, if its rounds took `seconds`, would reach the chosen width's expected rate in `group`
        (a faster refresh of a width that would still trail is kept as one more time, not a reason to retime it)."""
        bucket = self._buckets[group]
        if bucket.best is None:
            return True
        requests = group[0] if requests is None else requests
        chosen = self._cost(bucket.best, group, requests)
        saving = requests * self.admission_saving(width)
        return chosen is None or (self._rate(self.expected_tokens(width), seconds + bucket.overhead(), saving)
                                  >= self.expected_tokens(bucket.best) / chosen)

    def summary(self) -> dict[tuple[int, int], dict[int, dict[str, float | None]]]:
        """Per group of rounds (`group`: rows, and requests up to a power of two), per width: current round
        milliseconds, the group's overhead milliseconds (the server's step around a round, every width's), expected
        tokens per row, and tokens per second per row (the round and the overhead)."""
        return {group: {width: {"round_ms": None if bucket.seconds(width) is None else 1e3 * bucket.seconds(width),
                                "overhead_ms": 1e3 * bucket.overhead(),
                                "tokens_per_row": self.expected_tokens(width),
                                "tokens_per_second_per_row": self.throughput(width, *group)}
                        for width in self.widths}
                for group, bucket in sorted(self._buckets.items())}


class _WidthTimes:
    """One group's round times (`RoundWidthChooser.group`), and the schedule of its refreshes. The chosen width's last
    log times are the `reference`; every other width's are kept relative to the reference's median when they ran
    (before the first choice: as they are, relative to 0)."""

    def __init__(self, widths: tuple[int, ...], window: int, refresh_every: int, samples: int, reference_rounds: int):
        self.relative = {width: deque(maxlen=window) for width in widths}
        self.reference: deque[float] = deque(maxlen=reference_rounds)
        self.after_switch: deque[float] = deque(maxlen=window)  # see `switch_cost`
        self._switch_cost: float | None = None
        self.overheads: deque[float] = deque(maxlen=window)  # see `overhead`
        self._overhead: float | None = None
        self.samples = samples
        self._offsets: dict[int, float | None] = dict.fromkeys(widths)
        self._level: float | None = None  # the reference's median (None: to compute from `reference`)
        self.stale: set[int] = set()  # widths timed since their offset was last taken
        self.runs = dict.fromkeys(widths, 0)
        self.measure_turns = dict.fromkeys(widths, 0)  # rounds `choose` gave each width to measure it
        self.last_run = dict.fromkeys(widths, 0)
        self.interval = dict.fromkeys(widths, refresh_every)
        self.best: int | None = None
        self.rounds = 0
        self.retiming: set[int] = set()  # widths whose stale times were dropped, timed again before the next choice
        self.confirming: int | None = None  # a width about to replace the choice, being timed afresh first
        self.settled_until = 0  # the round before which `best` stands without a new comparison

    def add(self, width: int, log_seconds: float, after_other: bool = False, may_retime: bool = True) -> None:
        """A timed round of `width`; `after_other`: it followed a round of another width (the chosen width's such
        rounds measure `switch_cost`; another width's come with it subtracted). A refresh faster than every kept time
        of its width means they are stale (e.g. measured while the machine was still warming up): with `may_retime`
        they are dropped and the width is timed again."""
        if width == self.best:
            if after_other:
                self.after_switch.append(log_seconds - self.level())
                self._switch_cost = None
            else:
                self.reference.append(log_seconds)
                self._level = None  # (taken when read: most rounds read none)
            return
        kept = self.relative[width]
        value = log_seconds - self.level()
        if may_retime and self.best is not None and len(kept) >= self.samples and value < min(kept):
            kept.clear()
            self.retiming.add(width)
        kept.append(value)
        self.stale.add(width)
        if len(kept) >= self.samples:
            self.retiming.discard(width)

    def add_overhead(self, seconds: float) -> None:
        """A round's seconds of the server's step around it (`RoundWidthChooser.record`'s `overhead`)."""
        self.overheads.append(seconds)
        self._overhead = None

    def overhead(self) -> float:
        """The mean of the last `window` rounds' overheads, every width's (0 before any)."""
        if self._overhead is None:
            self._overhead = statistics.fmean(self.overheads) if self.overheads else 0.0
        return self._overhead

    def switch_cost(self) -> float:
        """How much longer, in log time, the choice's rounds take right after a round of another width: the median
        of the last `window` such rounds relative to `level`, once there are `samples` (0 before)."""
        if self._switch_cost is None:
            kept = self.after_switch
            self._switch_cost = statistics.median(kept) if len(kept) >= self.samples else 0.0
        return self._switch_cost

    def level(self) -> float:
        """The choice's log round time: the median of `reference` (0 before the first choice)."""
        if self._level is None:
            self._level = statistics.median(self.reference) if self.reference else 0.0
        return self._level

    def offset(self, width: int) -> float | None:
        """`width`'s log time relative to the choice's: the median of its kept values once they hold `samples`
        (the choice: 0; None before)."""
        if width == self.best:
            return 0.0
        if width in self.stale:
            self.stale.discard(width)
            kept = self.relative[width]
            self._offsets[width] = statistics.median(kept) if len(kept) >= self.samples else None
        return self._offsets[width]

    def seconds(self, width: int) -> float | None:
        """`width`'s current round time (None: not measured yet)."""
        offset = self.offset(width)
        return None if offset is None else math.exp(self.level() + offset)

    def choose(self, width: int, seconds: float) -> None:
        """Makes `width` the choice, whose round takes `seconds` now (measured here or borrowed): its time becomes
        the reference and every other width's kept values are re-expressed relative to it (the old choice's as the
        negated values of `width`'s)."""
        shift = self.offset(width)
        if shift is None:  # (its time borrowed from another group)
            shift = math.log(seconds) - self.level()
        moved = list(self.relative[width])
        for other, kept in self.relative.items():
            if other != width:
                self.relative[other] = deque((value - shift for value in kept), maxlen=kept.maxlen)
                self.stale.add(other)
        if self.best is not None:  # (its own list was empty while it was the choice)
            self.relative[self.best].extend(-value for value in moved)
            self.reference = deque((value + shift for value in self.reference), maxlen=self.reference.maxlen)
        else:  # before the first choice every kept value is a log time
            self.reference.extend(moved or [math.log(seconds)])
        self._level = None
        self.relative[width].clear()
        self.best = width
