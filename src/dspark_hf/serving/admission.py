"""When waiting requests join the running batch: `FreeRowsGate` (`DSparkEngine(admission_batch=N)`) and `JoinGate`
(`admission_batch="auto"`). Per round, the engine asks `rows_to_join` before the round and calls `record` after it.

A join stalls every running request for the joiners' prefill; holding it back leaves free rows idle. The prefill
costs about the same however many of its rows it fills: the static engine admits in sets of `rows_per_set` rows
(one chunk graph, `generation.static_admission.ChunkedAdmission`), and an eager prefill of a few prompts is
launch-bound. On the H200 the Qwen3-4B shape at c = 128 paid 40-60 ms per 16-row set against 6 ms per round, and
joining as soon as one row was free (51 joins of 2.5 rows per run) halved its throughput against joining once 16 rows
were free (docs/serving_measurements.md).

Each round the gate decides how many waiting requests join:

- every request that fits, when nothing runs, when every waiting request fits, or before a join into a running batch
  and a round have been timed;
- whole sets, when a set's rows or more are free; the rows left over wait for the next set (on the H200, joins of
  17-19 rows paid for two sets);
- otherwise none, until the idle cost since the hold began reaches the stall the join would cost; then every request
  that fits. The idle cost sums, over the held rounds, the free rows times the round's time; the stall is the running
  rows times one set's measured time (the median of recent joins). This is the ski-rental rule: in this cost model
  each join's idle and stall cost at most twice the best hold's in hindsight, and with rows freeing steadily it is the
  economic order quantity (idling and stalling cost the same per round). No row count to tune.
- A hold is skipped when it would most likely gather no other row: rows freeing r per round, the best hold lasts
  k = sqrt(2 × stall / (r × round time)) rounds (idle r k² / 2 row-rounds against the stall), and gathers r k rows;
  with r k < 1, i.e. 2 r × stall < round time, the free rows join at once (one running request, as at c = 2).

`benchmarks/admission_replay.py` models a measured cell under each setting.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class FreeRowsGate:
    """`admission_batch=N`: every free row takes a waiting request once N rows are free, or as many as are waiting,
    or when nothing runs."""

    def __init__(self, admission_batch: int):
        self.admission_batch = admission_batch

    def rows_to_join(self, free: int, waiting: int, running: int) -> int:
        return free if free >= min(self.admission_batch, waiting) or running == 0 else 0

    def record(self, admitted: int, admit_seconds: float, step_seconds: float) -> None:
        """(Nothing measured.)"""


class JoinGate:
    """Decides each round how many waiting requests join (see the module docstring). Per round, the engine calls
    `rows_to_join` before the round and `record` after it.

    Args:
        rows_per_set: rows one admission set prefills at about one cost (the static engine's admission rows; the eager
            engine's whole batch).
        window: recent joins whose per-set times' median is the join cost (and recent rounds, the round time).
        rate_window: recent rounds whose mean of rows freed is the freeing rate.
    """

    def __init__(self, rows_per_set: int, window: int = 9, rate_window: int = 16):
        if rows_per_set < 1 or window < 1 or rate_window < 1:
            raise ValueError(f"JoinGate needs rows_per_set, window and rate_window >= 1, got {rows_per_set}, {window} "
                             f"and {rate_window}.")
        self.rows_per_set = rows_per_set
        self._set_seconds: deque[float] = deque(maxlen=window)
        self._step_seconds: deque[float] = deque(maxlen=window)
        self._freed: deque[int] = deque(maxlen=rate_window)  # rows freed before each recent round
        self._idle_row_seconds = 0.0  # since the hold began
        self._held_rows = 0  # free rows the coming round leaves idle while requests wait
        self._running = 0  # rows running when the coming round's join was decided
        self._free = 0  # ... and free then
        self._free_after: int | None = None  # rows free after the last round's join

    def set_seconds(self) -> float | None:
        """The measured time of one admission set (median of recent joins), or None before any."""
        return statistics.median(self._set_seconds) if self._set_seconds else None

    def rows_to_join(self, free: int, waiting: int, running: int) -> int:
        """How many of the `waiting` requests join now, with `free` rows free and `running` requests running."""
        if self._free_after is not None:
            self._freed.append(max(0, free - self._free_after))
        self._running, self._free, self._held_rows = running, free, 0
        fits = min(free, waiting)
        if waiting == 0:  # (a later hold starts afresh)
            self._idle_row_seconds = 0.0
        set_seconds = self.set_seconds()
        if running == 0 or free >= waiting or set_seconds is None or not self._step_seconds:
            return fits
        if free >= self.rows_per_set:
            return free // self.rows_per_set * self.rows_per_set
        stall = running * set_seconds
        freed_per_round = statistics.fmean(self._freed) if self._freed else 0.0
        if self._idle_row_seconds >= stall or 2 * freed_per_round * stall < statistics.median(self._step_seconds):
            return fits  # the hold has cost the stall, or the best hold would gather no other row
        self._held_rows = free
        return 0

    def record(self, admitted: int, admit_seconds: float, step_seconds: float) -> None:
        """After a round: `admitted` requests joined it, in `admit_seconds`; its draft + verify took `step_seconds`."""
        if admitted:
            if self._running:  # (a first prefill of the whole batch is no join's cost)
                self._set_seconds.append(admit_seconds / math.ceil(admitted / self.rows_per_set))
            self._idle_row_seconds = 0.0
        else:
            self._idle_row_seconds += self._held_rows * step_seconds
        if step_seconds > 0:
            self._step_seconds.append(step_seconds)
        self._held_rows, self._free_after = 0, self._free - admitted
