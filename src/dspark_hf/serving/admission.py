"""`JoinGate`: when waiting requests join the running batch (`DSparkEngine(admission_batch="auto")`).

A join stalls every running request for the joiners' prefill; holding it back leaves free rows idle. The prefill
costs about the same however many of its rows it fills: the static engine admits in sets of `rows_per_set` rows
(one chunk graph, `generation.static_admission.ChunkedAdmission`), and an eager prefill of a few prompts is
launch-bound. On the H200 the Qwen3-4B shape at c = 128 paid about 55 ms per 16-row set against 6 ms per round, and
joining as soon as one row was free (52 joins of 5 rows per run) halved its throughput against joining once 16 rows
were free (docs/serving_measurements.md).

The gate joins at once when nothing runs, when every waiting request fits, when a whole set of rows is free, or
before any join into a running batch has been timed. Otherwise it holds the join until the idle cost since the hold
began reaches the stall the join would cost. The idle cost sums, over the held rounds, the free rows a waiting
request could have taken times the round's time. The stall is the running rows times the measured time of one set,
the median of recent joins. This is the ski-rental rule: in this cost model, each join's idle and stall cost at
most twice the best hold's in hindsight, with no row count to tune.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class JoinGate:
    """Decides each round whether waiting requests join (see the module docstring). Per round, the engine calls
    `should_join` before the round and `record` after it.

    Args:
        rows_per_set: rows one admission set prefills at about one cost (the static engine's admission rows; the eager
            engine's whole batch).
        window: recent joins whose per-set times' median is the join cost.
    """

    def __init__(self, rows_per_set: int, window: int = 9):
        if rows_per_set < 1 or window < 1:
            raise ValueError(f"JoinGate needs rows_per_set >= 1 and window >= 1, got {rows_per_set} and {window}.")
        self.rows_per_set = rows_per_set
        self._set_seconds: deque[float] = deque(maxlen=window)
        self._idle_row_seconds = 0.0  # since the hold began
        self._held_rows = 0  # free rows the coming round leaves idle while requests wait
        self._running = 0  # rows running when the coming round's join was decided

    def set_seconds(self) -> float | None:
        """The measured time of one admission set (median of recent joins), or None before any."""
        return statistics.median(self._set_seconds) if self._set_seconds else None

    def should_join(self, free: int, waiting: int, running: int) -> bool:
        """Whether the `waiting` requests join now, with `free` rows free and `running` requests running."""
        self._running, self._held_rows = running, 0
        if waiting == 0:  # (a later hold starts afresh)
            self._idle_row_seconds = 0.0
        set_seconds = self.set_seconds()
        if running == 0 or free >= waiting or free >= self.rows_per_set or set_seconds is None:
            return True
        if self._idle_row_seconds >= running * set_seconds:
            return True
        self._held_rows = free
        return False

    def record(self, admitted: int, admit_seconds: float, step_seconds: float) -> None:
        """After a round: `admitted` requests joined it, in `admit_seconds`; its draft + verify took `step_seconds`."""
        if admitted:
            if self._running:  # (a first prefill of the whole batch is no join's cost)
                self._set_seconds.append(admit_seconds / math.ceil(admitted / self.rows_per_set))
            self._idle_row_seconds = 0.0
        else:
            self._idle_row_seconds += self._held_rows * step_seconds
        self._held_rows = 0
