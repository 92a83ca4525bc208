"""SpeculationGuard: drafts only while speculative rounds are not slower per token, per batch-size bucket."""

import pytest

from dspark_hf.scheduling import SpeculationGuard


def drive(guard: SpeculationGuard, rounds: int, batch: int, spec_cost: float, plain_cost: float) -> list[bool]:
    """`rounds` decisions with fixed seconds per committed token for each kind of round."""
    kinds = []
    for _ in range(rounds):
        drafted = guard.should_draft(batch)
        kinds.append(drafted)
        guard.record(batch, drafted, (spec_cost if drafted else plain_cost) * 10, 10)
    return kinds


def test_measures_both_kinds_then_keeps_the_faster_and_probes_the_other():
    guard = SpeculationGuard(probe_every=8, max_probe_every=8)
    kinds = drive(guard, 40, batch=4, spec_cost=0.5, plain_cost=1.0)
    assert kinds[:2] == [True, False]  # one measurement of each kind first
    assert kinds[2:].count(False) == len(kinds[2:]) // 8  # only the periodic probes are plain
    guard = SpeculationGuard(probe_every=8, max_probe_every=8)
    kinds = drive(guard, 40, batch=4, spec_cost=2.0, plain_cost=1.0)
    assert kinds[2:].count(True) == len(kinds[2:]) // 8  # drafting does not pay: plain rounds but for probes


def test_probes_back_off_while_they_confirm_the_winner():
    guard = SpeculationGuard(probe_every=4, max_probe_every=32, settle_samples=1)
    kinds = drive(guard, 2 + 4 + 8 + 16 + 32 + 32, batch=8, spec_cost=2.0, plain_cost=1.0)
    probes = [i - 2 for i, drafted in enumerate(kinds) if drafted and i >= 2]
    assert probes == [3, 11, 27, 59, 91]  # intervals 4, 8, 16, 32, then capped at 32


def test_a_probe_faster_than_the_winner_brings_the_next_probe_forward():
    guard = SpeculationGuard(probe_every=4, window=3, max_probe_every=64, settle_samples=1)
    drive(guard, 2 + 4 + 8 + 16 + 32, batch=8, spec_cost=2.0, plain_cost=1.0)  # interval has grown to 64
    kinds = drive(guard, 100, batch=8, spec_cost=0.5, plain_cost=1.0)  # drafting became cheap (e.g. load fell)
    first_probe = kinds.index(True)
    assert first_probe <= 64
    # confirmed after one short interval (not after further 64-round waits); then only doubling plain probes remain
    assert kinds[first_probe + 1:first_probe + 8].count(True) >= 4
    assert kinds[first_probe + 8:].count(False) <= 3


def test_follows_a_change_in_cost_and_keeps_buckets_apart():
    guard = SpeculationGuard(probe_every=4, window=3)
    drive(guard, 20, batch=3, spec_cost=0.5, plain_cost=1.0)
    assert drive(guard, 1, batch=3, spec_cost=0.5, plain_cost=1.0) == [True]
    kinds = drive(guard, 40, batch=3, spec_cost=3.0, plain_cost=1.0)  # load went up: drafting stopped paying
    assert kinds[-8:].count(True) <= 2
    assert drive(guard, 2, batch=200, spec_cost=3.0, plain_cost=1.0) == [True, False]  # bucket 256: fresh start
    assert set(guard.summary()) == {4, 256}


def test_bursty_acceptance_does_not_stop_drafting_that_pays_on_average():
    """Batch 1, acceptance in phases that follow the text: 6 rounds accepting nothing, then 6 accepting all 7 drafts.
    A speculative round costs 2 time units, a plain one 1: drafting commits 4.5 tokens per 2 units on average."""
    guard = SpeculationGuard()
    kinds = []
    for round_index in range(300):
        drafted = guard.should_draft(1)
        kinds.append(drafted)
        tokens = (1 if round_index % 12 < 6 else 8) if drafted else 1
        guard.record(1, drafted, 2.0 if drafted else 1.0, tokens)
    assert kinds[50:].count(True) >= 0.85 * len(kinds[50:])


def test_a_slow_first_speculative_round_is_outvoted_within_a_few_rounds():
    guard = SpeculationGuard()
    kinds = []
    for round_index in range(60):
        drafted = guard.should_draft(1)
        kinds.append(drafted)
        first = drafted and not any(kinds[:-1])
        guard.record(1, drafted, (100.0 if first else 2.0) if drafted else 1.0, 4 if drafted else 1)  # compiled once
    assert kinds.index(True, 1) <= 17 and kinds[20:].count(False) <= 3  # then only probes of plain rounds


def test_one_stall_does_not_flip_the_decision():
    guard = SpeculationGuard(probe_every=100, window=5)
    drive(guard, 6, batch=1, spec_cost=0.5, plain_cost=1.0)
    guard.record(1, True, 50.0, 1)  # e.g. a kernel compiled during this round
    assert guard.should_draft(1)


def test_rounds_without_tokens_are_ignored_and_arguments_checked():
    guard = SpeculationGuard()
    guard.record(2, True, 1.0, 0)
    assert guard.summary() == {}
    with pytest.raises(ValueError):
        SpeculationGuard(probe_every=1)
    with pytest.raises(ValueError):
        SpeculationGuard(probe_every=16, max_probe_every=8)
