"""`JoinGate` (DSparkEngine(admission_batch="auto")): how many waiting requests join, decided on measured times."""

from __future__ import annotations

import pytest

from dspark_hf.serving.admission import JoinGate

STEP = 1 / 128  # a round's seconds (binary fractions: the sums below are exact)


def timed_gate(rows_per_set: int = 64, set_seconds: float = 1 / 16) -> JoinGate:
    """A gate that has timed one join into a running batch (one set of `set_seconds`) and one round (STEP)."""
    gate = JoinGate(rows_per_set)
    assert gate.rows_to_join(free=1, waiting=1000, running=60) == 1  # nothing timed yet: join (and time it)
    gate.record(admitted=1, admit_seconds=set_seconds, step_seconds=STEP)
    assert gate.set_seconds() == set_seconds
    return gate


def rounds_held(gate: JoinGate, running: int, freed_per_round: int, free: int = 0) -> tuple[int, int]:
    """Rows free up `freed_per_round` a round (`running` stays, for simple sums); returns the rounds the gate held the
    join and the requests it then let in."""
    for held in range(1000):
        free += freed_per_round
        joining = gate.rows_to_join(free, waiting=1000, running=running)
        if joining:
            return held, joining
        gate.record(admitted=0, admit_seconds=0.0, step_seconds=STEP)
    raise AssertionError("the gate never let the join through")


def test_lets_in_at_once_when_holding_cannot_pay():
    gate = JoinGate(rows_per_set=4)
    assert gate.rows_to_join(free=8, waiting=20, running=0) == 8  # nothing runs
    gate.record(admitted=8, admit_seconds=9.0, step_seconds=STEP)  # (the first prefill: no join's cost)
    assert gate.set_seconds() is None
    assert gate.rows_to_join(free=1, waiting=20, running=7) == 1  # no join timed yet
    gate = timed_gate(rows_per_set=4)
    assert gate.rows_to_join(free=2, waiting=2, running=6) == 2  # every waiting request fits
    assert gate.rows_to_join(free=9, waiting=20, running=55) == 8  # whole sets; the ninth row waits for the next


def test_holds_until_the_idle_rows_cost_what_the_join_stalls():
    """Ski rental: 60 rows running, a 1/16 s set, rounds of 1/128 s, one more row free each round. The k-th round's
    decision sees k free rows and (k - 1) k / 2 row-rounds idled; the join goes once that reaches the stall,
    60 / 16 s = 480 row-rounds: k = 32 (496), after 31 rounds held. A stall of 120 row-rounds: k = 16 (120)."""
    assert rounds_held(timed_gate(), running=60, freed_per_round=1) == (31, 32)
    assert rounds_held(timed_gate(set_seconds=1 / 64), running=60, freed_per_round=1) == (15, 16)
    assert rounds_held(timed_gate(), running=15, freed_per_round=1) == (15, 16)


def test_does_not_hold_when_no_row_is_likely_to_free_meanwhile():
    """One running request, a set costing 3 rounds, rows freeing once in 16 rounds: the best hold (2 x 1/16 x 3
    rounds' stall < one round) would most likely gather no other row (the Qwen3-4B shape at c = 2), so the row joins
    at once; with rows freeing every round, it waits."""
    gate = timed_gate(set_seconds=3 * STEP)
    for _ in range(15):  # 15 rounds, nothing frees
        gate.rows_to_join(free=0, waiting=1000, running=2)
        gate.record(admitted=0, admit_seconds=0.0, step_seconds=STEP)
    assert gate.rows_to_join(free=1, waiting=1000, running=1) == 1
    assert rounds_held(timed_gate(set_seconds=3 * STEP), running=1, freed_per_round=1)[0] >= 1


def test_a_join_restarts_the_hold_and_its_cost_is_per_set():
    gate = timed_gate(rows_per_set=4)
    gate.record(admitted=9, admit_seconds=3 / 16, step_seconds=STEP)  # 9 rows: 3 sets of 1/16 s
    assert gate.set_seconds() == 1 / 16
    gate.record(admitted=1, admit_seconds=0.5, step_seconds=STEP)
    gate.record(admitted=1, admit_seconds=0.5, step_seconds=STEP)
    assert gate.set_seconds() == pytest.approx((1 / 16 + 0.5) / 2)  # the median of four
    gate.record(admitted=1, admit_seconds=0.5, step_seconds=STEP)
    assert gate.set_seconds() == 0.5
    gate = timed_gate()
    assert rounds_held(gate, running=60, freed_per_round=1) == (31, 32)
    gate.record(admitted=32, admit_seconds=1 / 16, step_seconds=STEP)
    assert rounds_held(gate, running=60, freed_per_round=1) == (31, 32)  # the idle time starts afresh


def test_refuses_bad_settings():
    with pytest.raises(ValueError, match="rows_per_set"):
        JoinGate(0)
