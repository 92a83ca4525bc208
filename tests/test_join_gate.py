"""`JoinGate` (DSparkEngine(admission_batch="auto")): when waiting requests join, decided on measured times."""

from __future__ import annotations

import pytest

from dspark_hf.serving.admission import JoinGate


STEP = 1 / 128  # a round's seconds (binary fractions: the sums below are exact)


def measured_gate(rows_per_set: int = 4, set_seconds: float = 1 / 16) -> JoinGate:
    """A gate that has timed one join into a running batch: one set of `set_seconds`."""
    gate = JoinGate(rows_per_set)
    assert gate.should_join(free=1, waiting=5, running=7)  # nothing timed yet: join (and time it)
    gate.record(admitted=1, admit_seconds=set_seconds, step_seconds=STEP)
    assert gate.set_seconds() == pytest.approx(set_seconds)
    return gate


def rounds_held(gate: JoinGate, free: int, waiting: int, running: int, step_seconds: float) -> int:
    """Rounds the gate holds the join before letting it through (at most 1000)."""
    for held in range(1000):
        if gate.should_join(free, waiting, running):
            return held
        gate.record(admitted=0, admit_seconds=0.0, step_seconds=step_seconds)
    raise AssertionError("the gate never let the join through")


def test_joins_at_once_when_holding_cannot_pay():
    gate = JoinGate(rows_per_set=4)
    assert gate.should_join(free=8, waiting=20, running=0)  # nothing runs
    gate.record(admitted=8, admit_seconds=9.0, step_seconds=STEP)  # (the first prefill: no join's cost)
    assert gate.set_seconds() is None
    assert gate.should_join(free=1, waiting=20, running=7)  # no join timed yet
    gate = measured_gate()
    assert gate.should_join(free=2, waiting=2, running=6)  # every waiting request fits
    assert gate.should_join(free=4, waiting=20, running=4)  # a whole set is free


def test_holds_until_idle_rows_cost_what_the_join_stalls():
    """Ski rental: with one free row, 6 running and a 1/16 s set, the join waits until the free row has idled
    6 / 16 row-seconds: 48 rounds of 1/128 s; with two free rows, 24; with 3 running, half as long; with a 1/64 s
    set, a quarter."""
    assert rounds_held(measured_gate(), free=1, waiting=9, running=6, step_seconds=STEP) == 48
    assert rounds_held(measured_gate(), free=2, waiting=9, running=6, step_seconds=STEP) == 24
    assert rounds_held(measured_gate(), free=1, waiting=9, running=3, step_seconds=STEP) == 24
    assert rounds_held(measured_gate(set_seconds=1 / 64), free=1, waiting=9, running=6, step_seconds=STEP) == 12


def test_a_join_restarts_the_hold_and_its_cost_is_per_set():
    gate = measured_gate(rows_per_set=4, set_seconds=1 / 16)
    assert rounds_held(gate, free=1, waiting=9, running=6, step_seconds=STEP) == 48
    gate.record(admitted=9, admit_seconds=3 / 16, step_seconds=STEP)  # 9 rows: 3 sets of 1/16 s
    assert gate.set_seconds() == 1 / 16
    assert rounds_held(gate, free=1, waiting=9, running=6, step_seconds=STEP) == 48  # idle time starts afresh
    for joins in range(3):  # three slow joins: the median of five moves to 0.5 s
        if joins:
            rounds_held(gate, free=1, waiting=9, running=6, step_seconds=STEP)
        gate.record(admitted=1, admit_seconds=0.5, step_seconds=STEP)
    assert gate.set_seconds() == 0.5
    assert rounds_held(gate, free=1, waiting=9, running=6, step_seconds=STEP) == 384


def test_an_emptied_queue_ends_the_hold():
    gate = measured_gate()
    assert rounds_held(gate, free=1, waiting=9, running=6, step_seconds=STEP) == 48
    gate.record(admitted=0, admit_seconds=0.0, step_seconds=STEP)  # (it joined nobody: the requests were cancelled)
    assert gate.should_join(free=1, waiting=0, running=6)
    assert rounds_held(gate, free=1, waiting=9, running=6, step_seconds=STEP) == 48


def test_refuses_bad_settings():
    with pytest.raises(ValueError, match="rows_per_set"):
        JoinGate(0)
