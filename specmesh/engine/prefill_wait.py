"""How long a request waited behind prefill: the share of its wait (from its caller's submission to the step that
runs it) during which forwards carrying prefill ran. Plain floats (time.monotonic() seconds), no clock of its own.

The engine records the [start, end) of every forward that carried prefill tokens; a request's wait behind prefill
is the overlap of [submitted, scheduled) with those intervals. Only the last MAX_INTERVALS are kept: a request
that waited through more of them is undercounted, never overcounted.
"""

from __future__ import annotations

from collections import deque

MAX_INTERVALS = 1024


class PrefillClock:
    def __init__(self) -> None:
        self._intervals: deque[tuple[float, float]] = deque(maxlen=MAX_INTERVALS)

    def record(self, start: float, end: float) -> None:
        """A forward carrying prefill ran from `start` to `end` (forwards are recorded in order)."""
        if end > start:
            self._intervals.append((start, end))

    def waited(self, submitted: float, scheduled: float) -> float:
        """Seconds of [submitted, scheduled) during which a forward carrying prefill ran."""
        total = 0.0
        for start, end in reversed(self._intervals):
            if end <= submitted:
                break
            total += max(0.0, min(end, scheduled) - max(start, submitted))
        return total
