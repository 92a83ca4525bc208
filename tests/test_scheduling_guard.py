"""SpeculationGuard: drafts only while a speculative round commits more tokens per plain round of time, per bucket.
RoundWidthChooser: the static rounds' number of verified drafts, from measured round times and acceptance."""

import itertools
import json
import random
import statistics
from pathlib import Path

import pytest

from dspark_hf.scheduling import RoundWidthChooser, SpeculationGuard, SPSTable
from dspark_hf.scheduling.round_widths import AFTER_PLAIN, FULL, REFINED, acceptance_state


def drive(guard: SpeculationGuard, rounds: int, batch: int, cost, tokens_per_row, plain_seconds=lambda i: 1.0,
          catch_up_factor: float = 1.0, start: int = 0) -> list[bool]:
    """`rounds` decisions on a host-bound engine: a plain round takes `plain_seconds(i)`, which is also what a
    speculative round's verify part takes; the whole speculative round takes `cost(i)` times that (`catch_up_factor`
    times more right after plain rounds) and commits `tokens_per_row(i)` tokens per row. Constants work too."""
    as_fn = lambda v: v if callable(v) else (lambda i: v)  # noqa: E731
    cost, tokens_per_row = as_fn(cost), as_fn(tokens_per_row)
    kinds = []
    for i in range(start, start + rounds):
        drafted = guard.should_draft(batch)
        if drafted:
            plain = plain_seconds(i)
            catch_up = not (kinds[-1] if kinds else start > 0)
            seconds = cost(i) * plain * (catch_up_factor if catch_up else 1.0)
            guard.record(batch, seconds, plain, batch * 8, round(tokens_per_row(i) * batch), catch_up=catch_up)
        kinds.append(drafted)
    return kinds


def test_drafts_while_it_pays_and_otherwise_only_probes():
    assert all(drive(SpeculationGuard(), 200, batch=4, cost=2.0, tokens_per_row=3.0))
    guard = SpeculationGuard(probe_every=8, max_probe_every=8)
    kinds = drive(guard, 202, batch=4, cost=3.0, tokens_per_row=1.9)
    assert kinds[:2] == [True, True] and kinds[2] is False  # the first round only catches the drafter up
    probes = [i for i in range(3, 202) if kinds[i]]
    assert probes == [i for start in range(9, 202, 9) for i in (start, start + 1) if i < 202]  # every 8th round


def test_probes_back_off_while_they_confirm_plain_rounds():
    guard = SpeculationGuard(probe_every=4, max_probe_every=32, settle_samples=1)
    kinds = drive(guard, 200, batch=8, cost=3.0, tokens_per_row=1.5)
    starts = [i for i in range(2, 200) if kinds[i] and not kinds[i - 1]]
    assert all(kinds[i + 1] for i in starts)  # each probe: a catch-up round and a measured one
    assert [b - a for a, b in zip(starts, starts[1:])][:5] == [9, 17, 33, 33, 33]  # intervals 8, 16, 32, capped


def test_host_speed_phases_do_not_move_the_decision():
    """The virtual CPU runs everything up to 2.5x slower for stretches of rounds. Drafting pays by 25 % (2 tokens per
    row for 1.6 plain rounds of time): a guard that compared rounds timed in different phases would flip."""
    phases = lambda i: 2.5 if (i // 7) % 3 == 0 else 1.0  # noqa: E731
    kinds = drive(SpeculationGuard(), 400, batch=2, cost=1.6, tokens_per_row=2.0, plain_seconds=phases)
    assert all(kinds)
    kinds = drive(SpeculationGuard(), 400, batch=2, cost=2.4, tokens_per_row=2.0, plain_seconds=phases)
    assert kinds[50:].count(True) <= 0.1 * len(kinds[50:])  # and where it loses by 20 %, probes only


def test_catch_up_rounds_after_plain_rounds_are_not_held_against_drafting():
    guard = SpeculationGuard(probe_every=8, window=4)
    # drafting did not pay: plain rounds and probes, whose first round also feeds the drafter 8+ positions (10x)
    drive(guard, 100, batch=4, cost=3.0, tokens_per_row=1.5, catch_up_factor=10.0)
    assert guard.summary()[4]["speculative_round_in_plain_rounds"] == 3.0  # the probes' second rounds only
    # acceptance improved
    kinds = drive(guard, 300, batch=4, cost=2.0, tokens_per_row=4.0, catch_up_factor=10.0, start=100)
    assert kinds[-200:].count(False) == 0


def test_a_probe_in_which_drafting_paid_is_repeated_at_once():
    guard = SpeculationGuard(probe_every=4, window=5, max_probe_every=64, settle_samples=1)
    drive(guard, 150, batch=8, cost=3.0, tokens_per_row=1.5)  # the interval has grown to 64
    kinds = drive(guard, 100, batch=8, cost=1.5, tokens_per_row=3.0, start=150)  # drafting became cheap
    first_probe = kinds.index(True)
    assert first_probe <= 64
    assert all(kinds[first_probe:])  # probes repeat until the median agrees, then every round drafts


def test_bursty_acceptance_does_not_stop_drafting_that_pays_on_average():
    """Batch 1, acceptance in phases that follow the text: 6 rounds accepting nothing, then 6 accepting all 7 drafts.
    A speculative round costs 2 plain rounds: drafting commits 4.5 tokens per 2 plain rounds of time on average."""
    kinds = drive(SpeculationGuard(), 300, batch=1, cost=2.0, tokens_per_row=lambda i: 1 if i % 12 < 6 else 8)
    assert kinds[50:].count(True) >= 0.9 * len(kinds[50:])


def test_a_slow_first_speculative_round_is_outvoted_within_a_few_rounds():
    kinds = drive(SpeculationGuard(), 60, batch=1, cost=lambda i: 100.0 if i == 1 else 2.0, tokens_per_row=4.0)
    assert kinds.index(False) == 2 and kinds[20:].count(False) == 0  # compiled in round 1; back to drafting by 20


def test_one_stall_does_not_flip_the_decision():
    guard = SpeculationGuard(probe_every=100, window=5)
    drive(guard, 6, batch=1, cost=2.0, tokens_per_row=4.0)
    guard.record(1, 50.0, 1.0, 8, 1)  # e.g. a kernel compiled during this round
    assert guard.should_draft(1)


def test_the_sps_table_scales_a_long_verify_forward_to_a_plain_one():
    """A device-bound target: verifying 8 tokens per row takes 3 plain rounds; drafting adds 1. A round then costs
    4 plain rounds for 2.5 tokens per row: plain decoding is faster, which only the SPS table reveals."""
    table = SPSTable([4, 32], [300.0, 100.0])

    def run(guard):
        kinds = []
        for _ in range(200):
            drafted = guard.should_draft(4)
            if drafted:
                guard.record(4, 4.0, 3.0, 32, 10, catch_up=not (kinds and kinds[-1]))
            kinds.append(drafted)
        return kinds

    assert run(SpeculationGuard(sps_table=table))[20:].count(True) <= 0.1 * 180
    assert all(run(SpeculationGuard()))  # without it, the verify part passes for a plain round: 4/3 < 2.5


def test_buckets_are_kept_apart_and_summarised():
    guard = SpeculationGuard()
    drive(guard, 20, batch=3, cost=2.0, tokens_per_row=3.0)
    drive(guard, 20, batch=200, cost=3.0, tokens_per_row=1.5)
    assert guard.should_draft(3) and not guard.should_draft(200)
    summary = guard.summary()
    assert set(summary) == {4, 256}
    assert summary[4] == {"speculative_round_in_plain_rounds": 2.0, "tokens_per_row": 3.0, "drafting_pays": True}
    assert summary[256]["drafting_pays"] is False


def test_rounds_without_tokens_are_ignored_and_arguments_checked():
    guard = SpeculationGuard()
    guard.record(2, 1.0, 0.5, 16, 0)
    assert guard.summary() == {}
    with pytest.raises(ValueError):
        SpeculationGuard(probe_every=1)
    with pytest.raises(ValueError):
        SpeculationGuard(probe_every=16, max_probe_every=8)


def drive_widths(chooser: RoundWidthChooser, rounds: int, seconds: dict, hazards: list[float], rows: int = 16,
                 seed: int = 0, bucket: int = 0, captured: bool = False, requests: int | None = None) -> list[int]:
    """`rounds` rounds of `bucket` rows, `requests` of them holding a request (None: all): width v takes `seconds[v]`
    (ten times longer the first two times: compilation, unless `captured`: every graph captured beforehand), and each
    of `rows` requests accepts draft j (given drafts < j) with probability `hazards[j - 1]`."""
    rng = random.Random(seed)
    runs, chosen = dict.fromkeys(seconds, 0), []
    for _ in range(rounds):
        width = chooser.choose(bucket, requests)
        runs[width] += 1
        accepted = []
        for _ in range(rows):
            count = 0
            while count < width and rng.random() < hazards[count]:
                count += 1
            accepted.append(count)
        slow = runs[width] <= 2 and not captured
        chooser.record(width, seconds[width] * (10 if slow else 1), accepted, bucket, captured=captured,
                       requests=requests)
        chosen.append(width)
    return chosen


def test_width_chooser_estimates_acceptance_from_verified_drafts():
    chooser = RoundWidthChooser((0, 2, 4), decay=1.0)
    chooser.record(4, 1.0, [0, 1, 4, 4])  # draft 1 reached 4x, accepted 3x; draft 2: 3, 2; draft 3: 2, 2; 4: 2, 2
    chooser.record(2, 1.0, [2, 1])  # a round verifying 2: draft 1 reached 2, accepted 2; draft 2: 2, 1
    # each hazard is its posterior mean on a uniform prior: (accepted + 1) / (reached + 2)
    hazards = [6 / 8, 4 / 7, 3 / 4, 3 / 4]
    assert chooser.survival() == pytest.approx(_survival(hazards))
    assert chooser.expected_tokens(0) == 1.0
    assert chooser.expected_tokens(2) == pytest.approx(1 + 6 / 8 + 6 / 8 * 4 / 7)
    chooser.record(0, 1.0, [0, 0, 0])  # plain rounds carry no acceptance
    assert chooser.survival() == pytest.approx(_survival(hazards))
    chooser = RoundWidthChooser((0, 2, 4), decay=0.5)
    chooser.record(4, 1.0, [4, 4])
    chooser.record(2, 1.0, [0, 0])  # drafts 3 and 4 not verified: their counts are kept as they were
    assert chooser.survival()[2] / chooser.survival()[1] == pytest.approx(3 / 4)


@pytest.mark.parametrize("seconds, hazards, best", [
    ({0: 1.0, 1: 1.2, 3: 1.5, 7: 2.0}, [0.9] * 7, 7),  # cheap verification, good drafts: all of them
    ({0: 1.0, 1: 1.6, 3: 2.2, 7: 4.0}, [0.5] * 7, 0),  # drafting costs more than it brings: plain rounds
    ({0: 1.0, 1: 1.3, 3: 1.5, 7: 3.5}, [0.8] * 7, 3),  # a middle width
])
def test_width_chooser_settles_on_the_fastest_width_and_refreshes_the_others(seconds, hazards, best):
    chooser = RoundWidthChooser(tuple(seconds), refresh_every=50)
    chosen = drive_widths(chooser, 1200, seconds, hazards)
    assert chosen[:20] == sorted(seconds) * 5  # 2 warm-up + 3 timed rounds each, the widths in turn
    settled = chosen[20:]
    assert settled.count(best) > 0.95 * len(settled)
    assert set(settled) == set(seconds)  # the others are run again now and then, the farther behind the rarer
    expected = {v: (1 + sum(_survival(hazards)[:v])) / seconds[v] for v in seconds}
    refreshes = {v: settled.count(v) for v in seconds if v != best}
    nearest, farthest = max(refreshes, key=expected.get), min(refreshes, key=expected.get)
    assert refreshes[nearest] >= refreshes[farthest]
    expected = {v: (1 + sum(_survival(hazards)[:v])) / seconds[v] for v in seconds}
    assert max(expected, key=expected.get) == best  # the case is what it claims


def test_width_chooser_times_captured_rounds_from_the_first():
    """Rounds that replay graphs captured beforehand (`DSparkEngine.warm_up()`) are timed from the first: each width
    is explored for `samples` rounds instead of `warmup` + `samples`, and the choice is the same."""
    seconds = {0: 1.0, 1: 1.3, 3: 1.5, 7: 3.5}
    chosen = drive_widths(RoundWidthChooser(tuple(seconds)), 400, seconds, [0.8] * 7, captured=True)
    assert chosen[:12] == sorted(seconds) * 3
    assert chosen[12:].count(3) > 0.9 * len(chosen[12:])


def _survival(hazards):
    out, product = [], 1.0
    for h in hazards:
        product *= h
        out.append(product)
    return out


def test_width_chooser_follows_a_change_of_acceptance():
    """The text gets hard and stays so: the acceptance estimate (decay 0.999: about the last thousand rounds) moves
    to plain rounds within about a thousand rounds, and not within the first hundred."""
    seconds = {0: 1.0, 1: 1.2, 3: 1.5, 7: 2.0}
    chooser = RoundWidthChooser(tuple(seconds), refresh_every=20, max_refresh_every=160)
    assert drive_widths(chooser, 300, seconds, [0.9] * 7)[-50:].count(7) >= 48
    hard = drive_widths(chooser, 1500, seconds, [0.1] * 7, seed=1)  # the text got hard: plain rounds win
    assert hard[:100].count(0) < 10  # (a few requests' bad stretch does not move it)
    assert hard[-50:].count(0) >= 45  # (the change of choice restarted the others' refreshes at 20 rounds)


FIELD = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "acceptance_field_code50m_cpu.json"


def test_width_chooser_reads_narrower_widths_from_the_strides_of_the_rounds_it_runs():
    """A row's round of 7 drafts that committed T tokens stands for ceil(T / (v + 1)) rounds of v drafts: with width 7
    the choice, width v's tokens per round are the committed tokens over those rounds; the hazards (counted per round)
    give fewer for width 3. Width 0 commits one token a round either way; `strides=False` keeps the hazards."""
    accepted = [7, 7, 0, 5, 2, 1, 7, 3]
    choosers = {strides: RoundWidthChooser((7,), warmup=0, samples=1, strides=strides) for strides in (True, False)}
    for chooser in choosers.values():
        for _ in range(12):
            chooser.record(chooser.choose(), 1.0, accepted)
    committed = sum(count + 1 for count in accepted)
    for width in (0, 1, 3, 7):
        rounds = sum(-(-(count + 1) // (width + 1)) for count in accepted)
        assert choosers[True].expected_tokens(width) == pytest.approx(committed / rounds)
    hazards = choosers[False]
    assert hazards.expected_tokens(3) == list(itertools.accumulate(hazards.survival(), initial=1.0))[3]
    assert hazards.expected_tokens(3) < 0.97 * choosers[True].expected_tokens(3)


@pytest.mark.skipif(not FIELD.exists(), reason="needs benchmarks/results/acceptance_field_code50m_cpu.json")
def test_width_chooser_on_real_acceptance_runs_the_best_width_where_hazards_alone_lean_wider():
    """code50m's acceptance field (each position of 64 real requests: the drafts a round anchored there accepts; rows
    walk the requests one after another, 4 rows, 6000 rounds). Width 3 serves 5 % more than width 7 per second (fixed
    walks: 1.895 and 1.990 tokens a round). Taking width 3 from the strides of width 7's rounds, the chooser serves
    0.991-0.998 x width 3 after its first 1000 rounds (4 seeds); with the hazards alone it leans to width 7 in two of
    them (0.957-0.993, 0.977 on average)."""
    field = json.loads(FIELD.read_text())["accepted"]
    text = [count for request in field for count in request]
    tokens = {width: walk_tokens_per_round(text, width) for width in (0, 1, 3, 7)}
    seconds = {0: 0.36, 1: 0.52, 3: 0.57}
    seconds[7] = seconds[3] * tokens[7] / tokens[3] * 1.05
    best = tokens[3] / seconds[3]

    def served(strides: bool, seed: int) -> float:
        rng, chooser = random.Random(seed), RoundWidthChooser(tuple(seconds), seed=seed, strides=strides)
        positions, committed, elapsed = [row * len(text) // 4 for row in range(4)], 0, 0.0
        for index in range(6000):
            width = chooser.choose(4)
            accepted = [min(text[position % len(text)], width) for position in positions]
            positions = [position + count + 1 for position, count in zip(positions, accepted)]
            round_seconds = seconds[width] * rng.lognormvariate(0, 0.02)
            chooser.record(width, round_seconds, accepted, 4)
            if index >= 1000:
                committed, elapsed = committed + sum(accepted) + len(accepted), elapsed + round_seconds
        return committed / elapsed / 4 / best

    with_strides = [served(True, seed) for seed in range(4)]
    hazards_only = [served(False, seed) for seed in range(4)]
    assert min(with_strides) >= 0.99, (with_strides, hazards_only)
    assert statistics.mean(hazards_only) < statistics.mean(with_strides) - 0.01, (with_strides, hazards_only)


def walk_tokens_per_round(text: list[int], width: int) -> float:
    """Tokens per round of a row that runs every round at `width` drafts along `text` (the drafts a round anchored at
    each position accepts)."""
    position = rounds = 0
    while position < len(text) - 1:
        position += min(text[position], width) + 1
        rounds += 1
    return position / rounds


def drive_with_a_slow_start(chooser: RoundWidthChooser, rounds: int, seconds: dict, slow: float,
                            hazard: float) -> list[int]:
    """`rounds` rounds of 16 rows, each draft accepted with probability `hazard`: width v takes `seconds[v]`, but the
    widest width's first 5 rounds (2 warm-up rounds and the 3 timed ones) take `slow`."""
    rng, runs, chosen, widest = random.Random(0), dict.fromkeys(seconds, 0), [], max(seconds)
    for _ in range(rounds):
        width = chooser.choose()
        runs[width] += 1
        accepted = [sum(1 for _ in itertools.takewhile(lambda _: rng.random() < hazard, range(width)))
                    for _ in range(16)]
        chooser.record(width, slow if width == widest and runs[width] <= 5 else seconds[width], accepted)
        chosen.append(width)
    return chosen


def test_width_chooser_times_a_width_again_when_a_refresh_shows_its_times_are_stale():
    """Width 7's first timed rounds are slow (the machine was still warming up), then it costs what width 3 does and,
    verifying more drafts, wins. Its first refresh is faster than every kept time: they are dropped and it is timed
    again at once, instead of one sample per doubling interval (5 refreshes, ~1000 rounds, to move a median of 9)."""
    seconds = {0: 1.0, 3: 1.4, 7: 1.4}
    chooser = RoundWidthChooser(tuple(seconds), refresh_every=32)
    chosen = drive_with_a_slow_start(chooser, 300, seconds, slow=2.4, hazard=0.8)
    assert chosen[15:30].count(3) >= 14  # settled on 3 from 7's stale times
    assert chosen[-100:].count(7) >= 95  # ... and moved to 7 after its first refresh (7 is 18 % behind on its
    # stale times: its first refresh waits 32 x (1 + 0.18 / 0.05) rounds)
    assert chooser.summary()[0, 0][7]["round_ms"] == pytest.approx(1400)


def test_width_chooser_keeps_a_faster_refresh_of_a_trailing_width_as_one_more_time():
    """Width 7's first timed rounds are slow (2 s), its later ones 1.6 s: faster than every kept time, but with drafts
    accepted at 0.5 it would still trail width 3 (1.99 tokens a row in 1.6 s against 1.875 in 1.4 s). Its refresh is
    kept as one more time instead of dropping the others and spending `samples` rounds in a row retiming a width that
    cannot lead (as γ = 1 did at c = 16 for the Qwen3-4B shape on the H200)."""
    seconds = {0: 1.2, 3: 1.4, 7: 1.6}
    chooser = RoundWidthChooser(tuple(seconds), refresh_every=32)
    chosen = drive_with_a_slow_start(chooser, 400, seconds, slow=2.0, hazard=0.5)
    later = [index for index, width in enumerate(chosen) if width == 7 and index > 30]
    assert chosen[15:].count(3) > 0.95 * len(chosen[15:])
    assert later and all(width != 7 for index in later for width in chosen[index + 1:index + 3])  # refreshes alone
    assert chooser.summary()[0, 0][7]["round_ms"] == pytest.approx(2000)  # (the median of 2, 2, 2, 1.6, ...)


def test_width_chooser_does_not_change_its_choice_on_noise_between_equal_widths():
    """Widths 3 and 7 commit the same tokens per second (all drafts accepted, 7 takes twice as long), round times
    are noisy (log-normal, σ = 0.15). A width that looks better is timed afresh before it replaces the choice, and
    must then be `switch_margin` (2 %) better: over 8 seeds of 1000 rounds, after the 10 rounds that measure the two
    widths in turn, the choice changes in under 1 % of the rounds (56 changes; 56 without the margin: the confirmation
    does most of the work. Before it, 151 changes with the margin and 237 without, measuring rounds included.)"""
    def changes(margin: float) -> int:
        total = 0
        for seed in range(8):
            rng, chooser, chosen = random.Random(seed), RoundWidthChooser((3, 7), switch_margin=margin), []
            for _ in range(1000):
                width = chooser.choose()
                chooser.record(width, (1.0 if width == 3 else 2.0) * rng.lognormvariate(0, 0.15), [width] * 4)
                chosen.append(width)
            chosen = chosen[10:]  # (2 warm-up and 3 timed rounds of each width, in turn)
            total += sum(1 for before, after in zip(chosen, chosen[1:]) if before != after)
        return total

    assert changes(RoundWidthChooser((3,)).switch_margin) < 0.01 * 8000


def test_width_chooser_compares_widths_with_the_choice_timed_around_them():
    """The machine slows by a fifth over 700 rounds (every width alike). Width 7 is the best by about 9 %; widths
    0, 1 and 3 are refreshed now and then. Their kept times are relative to the choice's rounds around them, so the
    drift does not make them look faster than width 7, whose own times are recent: after the first 100 rounds, at
    most 3 % of the rounds run another width (each seed of 6), as without drift."""
    hazards = [0.45, 0.47, 0.47, 0.68, 0.68, 0.68, 0.68]
    seconds = {0: 1.5, 1: 2.1, 3: 2.16, 7: 2.17}
    for drift in (0.0, 0.2):
        for seed in range(6):
            rng, chooser, others = random.Random(seed), RoundWidthChooser(tuple(seconds)), 0
            for index in range(700):
                width = chooser.choose(64)
                accepted = [sum(1 for _ in itertools.takewhile(lambda j: rng.random() < hazards[j], range(width)))
                            for _ in range(64)]
                chooser.record(width, seconds[width] * (1 + drift * index / 700) * rng.lognormvariate(0, 0.05),
                               accepted, 64)
                others += index >= 100 and width != 7
            assert others <= 0.03 * 600, (drift, seed, others)


def drive_with_switch_cost(chooser: RoundWidthChooser, rounds: int, seconds: dict, hazard: float,
                           switch_cost: float, last: int | None = None) -> list[int]:
    """`rounds` rounds of 16 rows, each draft accepted with probability `hazard`: width v takes `seconds[v]`, and
    `switch_cost` more right after a round of another width (`last`: the width of the round before the first)."""
    rng, chosen = random.Random(0), []
    for _ in range(rounds):
        width = chooser.choose(16)
        accepted = [sum(1 for _ in itertools.takewhile(lambda _: rng.random() < hazard, range(width)))
                    for _ in range(16)]
        switched = last is not None and last != width
        chooser.record(width, seconds[width] * (1 + switch_cost if switched else 1), accepted, 16, captured=True)
        chosen.append(last := width)
    return chosen


def test_width_chooser_takes_the_cost_of_a_switch_out_of_the_other_widths_times():
    """A round right after a round of another width costs 8 % more (on an H100 the chosen width's round after a
    refresh cost 1-2 % more). Every refresh pays it, the chosen width's steady rounds never do: unless the chooser
    takes it out (measured on the chosen width's rounds right after a refresh), the others' times lean 8 % against
    them. Width 7 leads while drafts are accepted at 0.9; then they are accepted at 0.6 and width 3 leads by 6 %, less
    than the switch cost: the chooser moves to it (without the correction it stayed on width 7), and its times are
    the steady ones."""
    seconds = {0: 1.0, 3: 1.5, 7: 1.8}
    chooser = RoundWidthChooser(tuple(seconds), decay=0.95)  # (acceptance remembered for about 20 rounds)
    first = drive_with_switch_cost(chooser, 200, seconds, 0.9, 0.08)
    assert first[-50:].count(7) >= 48
    later = drive_with_switch_cost(chooser, 500, seconds, 0.6, 0.08, last=first[-1])
    assert later[-300:].count(3) >= 280
    assert {width: row["round_ms"] for width, row in chooser.summary()[16, 16].items()} == pytest.approx(
        {width: 1e3 * time for width, time in seconds.items()})
    expected = {v: (1 + sum(0.6 ** j for j in range(1, v + 1))) / seconds[v] for v in seconds}
    assert 1.05 < expected[3] / expected[7] < 1.07  # the case is what it claims


def test_width_chooser_times_a_width_afresh_before_it_replaces_the_choice():
    """Width 7 is chosen. Width 3's kept times (relative to 7's) say it is 30 % cheaper than it now is, enough to
    look better: it is timed afresh for `samples` rounds in a row, which shows it slower, and the choice stays."""
    seconds = {3: 1.5, 7: 2.0}
    chooser = RoundWidthChooser(tuple(seconds), refresh_every=1000, max_refresh_every=1000)
    chosen = drive_widths(chooser, 60, seconds, [1.0, 1.0, 1.0, 0.75, 0.75, 0.75, 0.75])
    assert chosen[-30:] == [7] * 30
    bucket = chooser._buckets[0, 0]
    bucket.relative[3] = type(bucket.relative[3])([value - 0.36 for value in bucket.relative[3]], maxlen=25)
    bucket.stale.add(3)
    bucket.settled_until = 0
    after, reasons = [], []
    for _ in range(20):  # (no compilation rounds now; no acceptance either: the estimates stay as they were)
        width = chooser.choose()
        chooser.record(width, seconds[width], [])
        after.append(width)
        reasons.append(chooser.reason)
    assert after[:3] == [3, 3, 3] and after[3:] == [7] * 17 and bucket.best == 7
    assert reasons[:4] == ["confirm", "measure", "measure", "keep"] and set(reasons[4:]) <= {"settled", "keep"}


def test_width_chooser_tells_why_it_chose_each_width_and_what_it_compared():
    """`reason` and `rates` after every `choose`: each width measured first, then the first choice, then settled
    rounds, comparisons that keep it (with every width's rate) and refreshes of the others."""
    seconds = {0: 1.0, 1: 1.2, 3: 1.5, 7: 2.0}
    chooser, rng = RoundWidthChooser(tuple(seconds), refresh_every=50), random.Random(0)
    log = []
    for _ in range(600):
        width = chooser.choose()
        log.append((width, chooser.reason, chooser.rates))
        accepted = [sum(1 for _ in itertools.takewhile(lambda _: rng.random() < 0.9, range(width))) for _ in range(16)]
        chooser.record(width, seconds[width], accepted, captured=True)
    assert [reason for _, reason, _ in log[:12]] == ["measure"] * 12
    assert log[12][:2] == (7, "switch") and set(log[12][2]) == set(seconds)
    later = log[13:]
    assert {reason for _, reason, _ in later} == {"settled", "keep", "refresh"}
    for width, reason, rates in later:
        assert (rates is None) == (reason == "settled")
        assert (width != 7) == (reason == "refresh")
        if rates is not None:
            assert max(rates, key=rates.get) == 7 and set(rates) == set(seconds)


def test_width_chooser_compares_rates_only_every_few_rounds_once_settled(monkeypatch):
    """The engine asks every round; a settled choice stands `decide_every` rounds without recomputing the rates (each
    comparison reads every width's tokens, `_rates`), and the refreshes still run when due."""
    seconds = {0: 1.0, 1: 1.2, 3: 1.5, 7: 2.0}

    def comparisons(decide_every: int) -> tuple[int, list[int]]:
        chooser = RoundWidthChooser(tuple(seconds), refresh_every=50, decide_every=decide_every)
        calls = []
        rates = chooser._rates
        monkeypatch.setattr(chooser, "_rates", lambda *args: calls.append(1) or rates(*args))
        chosen = drive_widths(chooser, 1200, seconds, [0.9] * 7)
        return len(calls), chosen

    every_round, chosen_every_round = comparisons(1)
    every_eighth, chosen = comparisons(8)
    assert every_eighth < 0.3 * every_round
    assert chosen.count(7) > 0.95 * (len(chosen) - 20) and set(chosen[20:]) == set(seconds)  # settled, refreshed
    refreshes = [i for i, width in enumerate(chosen) if width != 7]
    refreshes_every_round = [i for i, width in enumerate(chosen_every_round) if width != 7]
    assert [chosen[i] for i in refreshes] == [chosen_every_round[i] for i in refreshes_every_round]
    # the same refreshes, within a round or two: a refresh's wait depends on the gap in rates when they are compared
    assert all(abs(i - j) <= 2 for i, j in zip(refreshes, refreshes_every_round))


def test_width_chooser_does_not_stick_below_the_best_width_with_one_row_a_round():
    """One row per round (c = 1): each round tells one row's acceptance, so the hazards of drafts beyond the chosen
    width rest on the few rounds that verified them (refreshes). Rising hazards as replayed for the Qwen3-4B shape at
    c = 1 (7 drafts 15 % more tokens per second than 3). The counts of drafts a round does not verify are kept as
    they were rather than decayed, and a hazard nobody measured counts as its prior mean (1/2), not 0: all seeds but
    one end on 7 (when unverified counts decayed and hazards were compared as accepted / reached, 6 of 20 settled on
    3 and stayed). Over seeds 0-59, 59 end on 7, whether the widths are first measured one after another or in turn;
    the one that does not stays below 7 for 3000 rounds. Fixed seeds: deterministic."""
    seconds = {0: 4.2e-3, 1: 5.7e-3, 3: 5.9e-3, 7: 6.0e-3}
    hazards = [0.44, 0.6, 0.6, 0.75, 0.75, 0.75, 0.75]
    settled = 0
    for seed in range(20):
        chooser = RoundWidthChooser(tuple(seconds), seed=seed)
        chosen = drive_widths(chooser, 900, seconds, hazards, rows=1, seed=seed, captured=True)
        settled += chosen[-300:].count(7) > 0.8 * 300
    assert settled >= 19


def test_width_chooser_switches_only_when_confident():
    """A width whose expected rate is ahead replaces the choice only if it is ahead by `switch_margin` in at least
    `switch_confidence` of joint draws of the hazards from their posteriors: with one row's few verified drafts, a
    lead resting on a handful of lucky rows is not enough."""
    seconds = {3: 1.0, 7: 1.1}
    chooser = RoundWidthChooser(tuple(seconds), decay=1.0)
    for width, accepted in [(3, 3)] * 5 + [(7, 3), (7, 5), (7, 3), (7, 5), (7, 3)]:
        chooser.record(width, seconds[width], [accepted], captured=True)
    rates = chooser._rates(seconds)
    assert rates[7] > 1.05 * rates[3]  # ahead on the means...
    assert chooser.confidence(7, 3, seconds) < chooser.switch_confidence  # ... but on five rows' evidence
    for _ in range(40):
        chooser.record(7, seconds[7], [3, 5, 3, 5, 3] * 4, captured=True)
    assert chooser.confidence(7, 3, seconds) == 1.0 and chooser.confidence(3, 7, seconds) == 0.0


def test_width_chooser_times_each_number_of_rows_apart():
    """Rounds of 4 rows cost nearly the same at every width, rounds of 64 rows much more when they verify more: with the
    same acceptance, all drafts win in the first and plain rounds in the second, and the summary keeps both."""
    chooser = RoundWidthChooser((0, 1, 3, 7))
    small, large = {0: 1.0, 1: 1.05, 3: 1.1, 7: 1.2}, {0: 1.0, 1: 1.8, 3: 2.6, 7: 4.5}
    for _ in range(4):
        few = drive_widths(chooser, 100, small, [0.6] * 7, bucket=4)
        many = drive_widths(chooser, 100, large, [0.6] * 7, bucket=64)
    assert few[-50:].count(7) >= 48 and many[-50:].count(0) >= 48
    summary = chooser.summary()
    assert set(summary) == {(4, 4), (64, 64)} and summary[64, 64][7]["round_ms"] == pytest.approx(4500)
    # a new number of rows borrows the nearest measured one's times (8: from 4) instead of exploring every width
    assert chooser.choose(8) == 7 and chooser.throughput(0, 8) == chooser.throughput(0, 4)
    assert chooser.throughput(0, 32) == chooser.throughput(0, 64)  # (32 is nearer to 64)


def test_width_chooser_times_rounds_of_fewer_requests_apart():
    """The host's work on a round's tokens grows with its requests: in the 64-row graph, rounds of 8 requests take
    plain 0.5 s and width 3 1.2 s, against 1.0 and 1.5 with 64 (the end of a GPU run at c = 64 looked like that).
    Timed together, a draining batch's plain rounds make plain look best for the full graph too (as on an H100 at
    c = 64, where fixed γ = 3 served 1.09 x no speculation): told the requests, the chooser keeps each number of them
    (up to a power of two) apart, so the full graph's choice and times stay as they were, and a draining batch
    borrows them until its own are measured (no exploring)."""
    full, few = {0: 1.0, 3: 1.5}, {0: 0.5, 3: 1.2}
    for told in (True, False):
        chooser = RoundWidthChooser((0, 3))
        requests = (64, 8) if told else (None, None)
        first = drive_widths(chooser, 30, full, [0.6] * 3, rows=64, bucket=64, requests=requests[0])
        assert first[-20:] == [3] * 20
        draining = drive_widths(chooser, 40, few, [0.6] * 3, rows=8, bucket=64, requests=requests[1], captured=True)
        again = drive_widths(chooser, 60, full, [0.6] * 3, rows=64, bucket=64, requests=requests[0], captured=True)
        if told:  # (one refresh of plain in each)
            assert draining.count(3) == 39 and again.count(3) == 59
            summary = chooser.summary()
            assert set(summary) == {(64, 64), (64, 8)} and summary[64, 8][3]["round_ms"] == pytest.approx(1200)
            assert {width: row["round_ms"] for width, row in summary[64, 64].items()} == pytest.approx(
                {0: 1000, 3: 1500})
        else:  # (the case is what it claims: a plain refresh of the draining batch retimes plain, which then wins)
            assert draining[-20:] == [0] * 20 and again[-50:].count(0) >= 49
    assert chooser.group(64, 5) == chooser.group(64, 8) == (64, 8) and chooser.group(64, 33) == (64, 64)
    assert chooser.group(48, 40) == (48, 48) and chooser.group(2) == (2, 2)


def drive_with_overhead(chooser: RoundWidthChooser, rounds: int, seconds: dict, overhead, told: bool = True
                        ) -> list[int]:
    """`rounds` captured rounds of 16 rows accepting each draft at 0.5; `overhead(width, runs)` the server's step
    around a round (`runs`: that width's rounds so far), told as `overhead`, or with `told=False` in the round's
    seconds (the engine's whole step, as it was timed on 12-06 before this)."""
    rng, chosen, runs = random.Random(0), [], dict.fromkeys(seconds, 0)
    for _ in range(rounds):
        width = chooser.choose(16)
        runs[width] += 1
        accepted = []
        for _ in range(16):
            count = 0
            while count < width and rng.random() < 0.5:
                count += 1
            accepted.append(count)
        around = overhead(width, runs[width])
        if told:
            chooser.record(width, seconds[width], accepted, 16, captured=True, overhead=around)
        else:
            chooser.record(width, seconds[width] + around, accepted, 16, captured=True)
        chosen.append(width)
    return chosen


def test_width_chooser_adds_the_steps_overhead_to_every_width_alike():
    """Plain rounds take 1 s, width 3's 2 s and commit 1.875 tokens a row: without the server's step around the rounds
    (1 s each) plain leads by 7 %, with it width 3 by 25 %. The chooser adds the mean overhead of the group's rounds
    to every width, so a hiccup (here 3 s) in two of width 3's three measuring rounds does not count against width 3
    alone (timed inside each round's seconds, as for a few hours on 12-06, it chose plain; on an H100 at c = 4 a step
    that freed a finished request's row took 0.12 ms more, against 0.6 ms rounds, in about half the warm-up run's)."""
    seconds = {0: 1.0, 3: 2.0}
    steady = drive_with_overhead(RoundWidthChooser(tuple(seconds)), 300, seconds, lambda width, runs: 1.0)
    assert steady[-100:].count(3) >= 97
    without = drive_with_overhead(RoundWidthChooser(tuple(seconds)), 300, seconds, lambda width, runs: 0.0)
    assert without[-100:].count(0) >= 97
    def hiccups(width, runs):
        return 3.0 if width == 3 and runs in (1, 3) else 1.0
    chooser = RoundWidthChooser(tuple(seconds))
    assert drive_with_overhead(chooser, 40, seconds, hiccups)[6:20] == [3] * 14  # (6 measuring rounds first)
    assert chooser.summary()[16, 16][0]["overhead_ms"] == pytest.approx(1000)
    folded = drive_with_overhead(RoundWidthChooser(tuple(seconds)), 40, seconds, hiccups, told=False)
    assert folded[6:20].count(0) >= 12


def drive_with_admissions(chooser: RoundWidthChooser, rounds: int, seconds: dict, request_seconds: dict,
                          tokens_per_request: int = 8) -> list[int]:
    """`rounds` captured rounds of 16 rows accepting each draft at 0.5, where a request leaves after
    `tokens_per_request` tokens and another joins: after each round, an admission of the requests its tokens
    finished, each taking `request_seconds[True]` with the prompts' drafter context, `request_seconds[False]`
    without it (as the engine admits after 4 plain rounds in a row)."""
    rng, chosen, owed, plain_run = random.Random(0), [], 0.0, 0
    for _ in range(rounds):
        width = chooser.choose(16)
        accepted = [sum(1 for _ in itertools.takewhile(lambda _: rng.random() < 0.5, range(width)))
                    for _ in range(16)]
        chooser.record(width, seconds[width], accepted, 16, captured=True)
        plain_run = plain_run + 1 if width == 0 else 0
        owed += (16 + sum(accepted)) / tokens_per_request
        if owed >= 1:
            joining, owed = int(owed), owed - int(owed)
            chooser.record_finished(joining * tokens_per_request, joining)
            context = plain_run < 4
            chooser.record_admission(joining * request_seconds[context], joining, prompt_context=context)
        chosen.append(width)
    return chosen


def test_width_chooser_counts_the_admissions_a_width_brings_about():
    """Plain rounds take 1 s, width 3's 1.5 s and commit 1.875 tokens a row: width 3 leads by 25 %. Each request
    leaves after 8 tokens and its successor's admission takes 0.2 s with the drafter's context of its prompt: every
    width's tokens bring the same admissions about, and width 3 still leads (by 17 %). A long run of plain rounds
    admits without that context: at 0.04 s a request, plain leads by 11 %. The chooser credits plain rounds what
    their tokens' admissions save: a request's admission seconds of each kind (for plain rounds, until some were
    admitted without the context, `admission_ratio` times the other kind's: `StaticRows.warm_up` times the two
    admission graphs) over the tokens a request commits. So it moves to plain where the saving is real, and back to
    width 3 once plain's admissions, measured, save nothing. (On an H100 at c = 128 a drafting engine's admissions
    cost 9 % more than plain decoding's, a third of the serving time.)"""
    seconds = {0: 1.0, 3: 1.5}
    for request_seconds, ratio, best in (({True: 0.0, False: 0.0}, 1.0, 3), ({True: 0.2, False: 0.2}, 1.0, 3),
                                         ({True: 0.2, False: 0.04}, 0.2, 0)):
        chooser = RoundWidthChooser(tuple(seconds))
        chooser.admission_ratio = ratio
        chosen = drive_with_admissions(chooser, 400, seconds, request_seconds)
        assert chosen[-200:].count(best) >= 190, (request_seconds, best)
    assert chooser.admission_per_token(0) == pytest.approx(0.04 / 8, rel=0.1)  # (measured: plain's own admissions)
    assert chooser.admission_per_token(3) == pytest.approx(0.2 / 8, rel=0.1)
    assert chooser.admission_saving(0) == pytest.approx(0.16 / 8, rel=0.1) and chooser.admission_saving(3) == 0
    chooser = RoundWidthChooser(tuple(seconds))
    chooser.admission_ratio = 0.2  # an estimate that the measured plain admissions then refute
    chosen = drive_with_admissions(chooser, 1200, seconds, {True: 0.2, False: 0.2})
    assert 0 in chosen[:600] and chosen[-200:].count(3) >= 190
    assert chooser.admission_per_token(0) == pytest.approx(0.2 / 8, rel=0.1)


def test_width_chooser_refuses_bad_settings():
    with pytest.raises(ValueError, match="widths"):
        RoundWidthChooser(())
    with pytest.raises(ValueError, match="window >= samples"):
        RoundWidthChooser((0, 1), samples=5, window=3)
    with pytest.raises(ValueError, match="max_refresh_every"):
        RoundWidthChooser((0, 1), refresh_every=64, max_refresh_every=32)
    with pytest.raises(ValueError, match="switch_margin"):
        RoundWidthChooser((0, 1), switch_margin=-0.1)


def test_acceptance_states_tell_a_full_round_from_a_partial_one():
    assert acceptance_state(0, 0) == AFTER_PLAIN
    assert acceptance_state(7, 3) == 3 and acceptance_state(3, 0) == 0
    assert acceptance_state(3, 3) == FULL + 3 != acceptance_state(7, 3)  # (3 of 3: at least 3)
    assert acceptance_state(7, 7) == FULL + 7 != acceptance_state(1, 1) == FULL + 1


def test_width_chooser_estimates_acceptance_per_state_with_every_row_as_prior():
    chooser = RoundWidthChooser((0, 2), decay=1.0, state_prior=2.0)
    chooser.record(2, 1.0, [2, 2, 0, 1], states=[5, 5, 0, 0])
    # every row: draft 1 reached 4x, accepted 3x: (3 + 1) / (4 + 2); draft 2: 3, 2: (2 + 1) / (3 + 2)
    pooled = [2 / 3, 3 / 5]
    assert chooser.survival() == pytest.approx(_survival(pooled))
    # state 5: draft 1 reached 2x, accepted 2x; draft 2: 2, 2; each with 2 drafts added at the pooled hazard, or at
    # the state's own hazard of the draft before where that is higher (here draft 2's: 5/6 > 3/5)
    five = [(2 + 2 * pooled[0]) / 4]
    five.append((2 + 2 * max(pooled[1], five[0])) / 4)
    # state 0: draft 1 reached 2x, accepted 1x; draft 2 reached 1x, accepted 0x (7/12 < 3/5: the pooled hazard)
    zero = [(1 + 2 * pooled[0]) / 4]
    zero.append((0 + 2 * max(pooled[1], zero[0])) / 3)
    assert five[1] > (2 + 2 * pooled[1]) / 4 and zero[1] == (0 + 2 * pooled[1]) / 3
    for state, hazards in ((5, five), (0, zero), (3, pooled)):  # (state 3: never seen, the pooled estimate)
        assert chooser.state_tokens(state) == pytest.approx([1.0, *(1 + s for s in itertools.accumulate(
            _survival(hazards)))])
    chooser.record(0, 1.0, [0, 0], states=[5, 0])  # plain rounds carry no acceptance
    assert chooser.state_tokens(5)[2] == pytest.approx(1 + five[0] + five[0] * five[1])
    with pytest.raises(ValueError):
        RoundWidthChooser((0, 2), state_prior=0)


def test_width_chooser_counts_rows_per_state_every_state_every_rounds():
    """A round's rows are only tallied; `prepare` (every `state_every` rounds) or `state_tokens` counts them, each
    state's draft slot decaying once for each tallied row whose round verified it, and `refine`'s table is rebuilt
    only then."""
    chooser = RoundWidthChooser((0, 1, 2), decay=0.5, state_every=3, samples=1, warmup=0)
    chooser.record(2, 1.0, [2], states=[5])
    assert chooser._state_counts == {} and chooser.state_tokens(5)  # (reading folds the tally)
    assert chooser._state_counts[5] == ([1.0, 1.0], [1.0, 1.0])
    chooser.record(1, 1.0, [0], states=[5])  # verifies slot 1 only
    chooser.record(2, 1.0, [1], states=[5])
    chooser.state_tokens(5)
    # slot 1 verified by both rows (x 0.25), slot 2 by one (x 0.5); then the rows: reached 1 + 1 and 0 + 1 ...
    assert chooser._state_counts[5] == (pytest.approx([0.25 + 2, 0.5 + 1]), pytest.approx([0.25 + 1, 0.5 + 0]))
    for width in (0, 1, 2):
        chooser.record(width, 1.0 + width, [1] if width else [], captured=True)
    while (width := chooser.choose()) is not None and chooser.reason not in REFINED:
        chooser.record(width, 1.0 + width, [1] if width else [], captured=True)
    chooser.prepare()
    table = chooser._state_rates
    chooser.record(2, 1.0, [2], states=[FULL + 2])
    chooser.prepare()
    assert chooser._state_rates is table and FULL + 2 not in table[2]  # (rebuilt only after `state_every` rounds)
    chooser.record(2, 1.0, [2], states=[FULL + 2])
    chooser.record(2, 1.0, [2], states=[FULL + 2])
    chooser.prepare()
    assert chooser._state_rates is not table and FULL + 2 in chooser._state_rates[2]
    with pytest.raises(ValueError):
        RoundWidthChooser((0, 2), state_every=0)


def drive_regimes(chooser: RoundWidthChooser | None, width: int, rounds: int, seconds: dict, seed: int = 0) -> float:
    """One row whose text alternates between easy stretches (each draft accepted with probability 0.95) and hard ones
    (0.3), a stretch going on with probability 0.95 from round to round. Each round verifies `width` drafts, or what
    `chooser` picks (`choose`, then `refine` with the row's state after the last round). Returns tokens per second."""
    rng = random.Random(seed)
    easy, state, tokens, elapsed = True, AFTER_PLAIN, 0, 0.0
    for _ in range(rounds):
        if chooser is not None:
            width = chooser.refine(chooser.choose(), [state])
        accepted = 0
        while accepted < width and rng.random() < (0.95 if easy else 0.3):
            accepted += 1
        if chooser is not None:
            chooser.record(width, seconds[width], [accepted], captured=True, states=[state])
        state = acceptance_state(width, accepted)
        tokens, elapsed = tokens + accepted + 1, elapsed + seconds[width]
        easy = easy if rng.random() < 0.95 else not easy
    return tokens / elapsed


def test_width_chooser_follows_the_rows_state_from_round_to_round():
    """Text whose acceptance comes in stretches: after a round that accepted all its drafts the next round tends to
    accept many, after one that accepted few, few. `choose` alone settles on the best width for the average row;
    `refine` with each round's state picks widths round by round and serves more tokens per second than every fixed
    width (here 1.13x the best, 7 drafts). Fixed seeds: deterministic."""
    seconds = {0: 1.0, 1: 1.3, 3: 1.4, 7: 2.0}
    fixed = {width: drive_regimes(None, width, 4000, seconds) for width in seconds}
    chooser = RoundWidthChooser(tuple(seconds))
    chosen = drive_regimes(chooser, 0, 4000, seconds)
    assert max(fixed, key=fixed.get) == 7
    assert chosen > 1.08 * max(fixed.values())
    assert chooser.state_tokens(FULL + 7)[7] > 5 > 2.5 > chooser.state_tokens(0)[7]


def test_width_chooser_refines_its_choice_by_the_rows_states():
    """`refine` picks the width the rows' states favour. It changes neither a width returned to measure, confirm or
    refresh one, nor a drafting round into a plain one (a plain round may become a drafting one)."""
    seconds = {0: 1.0, 1: 1.1, 3: 1.2, 7: 1.4}
    chooser = RoundWidthChooser(tuple(seconds), decay=1.0, state_rows=4)
    width = chooser.choose()
    assert chooser.reason == "measure" and chooser.refine(width, [FULL + 7]) == width
    rng = random.Random(0)

    def accepted(width: int) -> list[int]:  # every draft accepted with probability 1/2: 3 drafts do best
        return [next(k for k in range(width + 1) if k == width or rng.random() < 0.5) for _ in range(4)]

    for _ in range(300):  # (and a round of 7 drafts after each: their acceptance in state 0 too)
        width = chooser.choose()
        chooser.record(width, seconds[width], accepted(width), captured=True, states=[0] * 4)
        chooser.record(7, seconds[7], accepted(7), captured=True, states=[0] * 4)
    for _ in range(3):  # rows after a full round of 7 accept all 7 again
        chooser.record(7, seconds[7], [7] * 2, captured=True, states=[FULL + 7] * 2)
    for _ in range(10):  # rows in state 2 accept none
        chooser.record(3, seconds[3], [0] * 4, captured=True, states=[2] * 4)
    while (width := chooser.choose()) and chooser.reason == "refresh":
        chooser.record(width, seconds[width], [], captured=True)
    assert width == 3 and chooser.reason in ("settled", "keep")
    assert chooser.refine(width, [0] * 4) == 3 and chooser.reason != "state"
    assert chooser.refine(width, [FULL + 7, 0, FULL + 7, 0]) == 7 and chooser.reason == "state"
    assert chooser.rates[7] > chooser.rates[3]
    chooser.reason = "keep"
    assert chooser.refine(width, [2] * 4) == 1  # rows that accept none: the narrowest drafting round, never a plain one
    chooser.reason = "keep"
    assert chooser.refine(width, [FULL + 7] * 4 + [0]) == width  # more than `state_rows` rows: as chosen
    chooser.reason = "keep"
    assert chooser.refine(0, [FULL + 7] * 4) == 7  # a plain round may become a drafting one


def test_width_chooser_tries_a_wider_width_for_rows_that_accept_more_than_the_average():
    """With γ = 3 chosen the average row's drafts 4-7 are verified only by rare rounds of 7, here unlucky ones (slot 4
    reached 4 times, never accepted). Rows that just accepted all 3 drafts accept each draft with probability 0.8: their
    drafts 4-7 take that rate, not the average row's, so `refine` gives them 7 drafts (on an H100 at c = 1, with the
    average row's rate as their prior, it never did, though fixed γ = 7's rounds after such a round accepted 2.87
    drafts); rows that accepted none keep 3. Its answers are kept until `prepare` builds its table again."""
    seconds = {0: 0.34, 1: 0.49, 3: 0.5, 7: 0.55}
    chooser = RoundWidthChooser(tuple(seconds), decay=1.0, state_every=4)
    rng = random.Random(0)
    for _ in range(4):
        chooser.record(7, seconds[7], [3], captured=True)
    for index in range(600):  # rows in state 0 accept each draft with probability 0.45, in FULL + 3 with 0.8
        width = chooser.choose()
        state = FULL + 3 if index % 5 == 0 else 0
        rate = 0.8 if state == FULL + 3 else 0.45
        chooser.record(width, seconds[width], [next(k for k in range(width + 1) if k == width or rng.random() > rate)],
                       captured=True, states=[state])
    assert chooser.choose() == 3 and chooser.reason in REFINED
    # the average row: 7 drafts cost 1.1x as much as 3 and bring less than 1.1x the tokens (the unlucky rounds of 7)
    assert chooser.expected_tokens(7) < 1.05 * chooser.expected_tokens(3)
    chooser.prepare()
    assert chooser.refine(3, [FULL + 3]) == 7 and chooser.reason == "state"
    assert chooser.state_tokens(FULL + 3)[7] > 1.15 * chooser.state_tokens(FULL + 3)[3]
    chooser.reason = "settled"
    assert chooser.refine(3, [0]) == 3 and chooser.reason == "settled"
    assert set(chooser._refined) == {(True, FULL + 3), (True, 0)}
    for _ in range(4):  # (`state_every` rounds later the table is built again, and the answers with it)
        chooser.record(3, seconds[3], [0], captured=True, states=[0])
    chooser.prepare()
    assert chooser._refined == {} and chooser.refine(3, [FULL + 3]) == 7


def test_width_chooser_refines_a_settled_choice_while_another_group_times_a_width_again():
    """Rounds of 4 rows holding 1-4 requests (a draining batch) keep their times in groups. A refresh in one group
    that runs faster than the width's kept times drops them (`test_width_chooser_times_a_width_again_...`); if no
    group then has a time of that width, a settled choice in another group still stands, and `prepare` / `refine`
    must leave it as it is until the width is timed again (on an H100 at c = 4 `prepare` divided by the missing time;
    these seeds' walks reach two such rounds)."""
    base = {0: 0.3, 1: 0.45, 3: 0.5, 7: 0.55}
    missing = 0
    for seed in range(40):
        rng = random.Random(seed)
        chooser = RoundWidthChooser(tuple(base), strides=seed % 2 == 0)
        for _ in range(300):
            requests = rng.choice([4, 4, 4, 4, 3, 2, 1]) if rng.random() < 0.3 else 4
            width = chooser.choose(4, requests)
            chooser.prepare(4, requests)
            states = [rng.randrange(4) for _ in range(requests)]
            if chooser.reason in REFINED and any(chooser.throughput(other, 4, requests) is None
                                                 for other in base):
                missing += 1
                assert chooser.refine(width, states, 4) == width and chooser.reason in REFINED
            elif requests <= chooser.state_rows:
                width = chooser.refine(width, states, 4)
            seconds = base[width] * rng.uniform(0.9, 1.3) * (1 + 0.1 * requests / 4)
            accepted = [min(width, int(rng.expovariate(0.5))) for _ in range(requests)]
            chooser.record(width, seconds, accepted, rows=4, requests=requests, states=states,
                           overhead=rng.uniform(0, 0.1))
    assert missing > 0


def test_width_chooser_keeps_refined_rounds_out_of_the_average_rows_estimate():
    """A round whose width `refine` chose for its rows' states (`record(..., refined=True)`) counts for those states
    only. Rows that had just accepted all 7 drafts accept all 7 again; were such rounds counted for the average row,
    whose drafts 4-7 other rounds verify seldom, γ = 7 would look better for every round (on an H100 at c = 4 the
    chooser then took γ = 7 where fixed γ = 3 served 4 % more)."""
    def chooser_after(refined: bool) -> RoundWidthChooser:
        rng, chooser = random.Random(0), RoundWidthChooser((0, 3, 7), decay=1.0)
        for index in range(400):  # every draft accepted with probability 1/2; width 7 now and then
            width = 7 if index % 20 == 0 else 3
            accepted = [next(k for k in range(width + 1) if k == width or rng.random() < 0.5) for _ in range(4)]
            chooser.record(width, 1.0, accepted, captured=True, states=[acceptance_state(3, 1)] * 4)
        for _ in range(20):  # rows after a full round, given 7 drafts by `refine`
            chooser.record(7, 1.2, [7, 7], captured=True, states=[FULL + 7] * 2, refined=refined)
        return chooser

    kept_out, counted = chooser_after(True), chooser_after(False)
    # the average row: 1 + 1/2 + ... + 1/2^7 = 1.99 tokens a round at width 7, 1.875 at width 3
    assert kept_out.expected_tokens(7) == pytest.approx(1.99, abs=0.08)
    assert counted.expected_tokens(7) > kept_out.expected_tokens(7) + 0.2
    assert kept_out.expected_tokens(3) == pytest.approx(1.875, abs=0.05)
    assert kept_out.state_tokens(FULL + 7)[7] > 6  # (the rows after a full round still count for their state)
