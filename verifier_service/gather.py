"""Waiting a moment for the sessions the last forward answered, so that concurrent streams share one forward.

A session's next verify reaches the engine r seconds after its answer (the gateway emits the tokens, drafts or not,
and sends the next Verify). A forward takes f seconds, and r << f without a draft round. Starting the next forward
as soon as anything is queued splits the streams into groups that alternate: the sessions answered by forward N
come back a few milliseconds after forward N + 1, holding the sessions that arrived during N, has started, and so
on. On a compute-bound CPU a forward of n rows costs t(n) = a + b (n - 1) (Qwen2.5-1.5B int4, one Zen 4 core:
a ~50 ms, b ~9.5 ms), so two forwards of 8 rows cost 2a + 14b against a + 15b for one of 16: more verifier
time for the same tokens, ~20% (measured at 16 streams: forwards averaged 8.5 sessions).

So before a step, while sessions answered by the last forward are expected back within the window (each by its
own measured return time: the median of its last few, times SLACK), the engine waits for them, up to the window's
end. A median, because a drafting session's returns are mostly fast (a local suffix lookup, or nothing drafted:
4 ms at 8 streams of the real pair) with a model round now and then (220 ms). The
window is `share` of the last forward's seconds, at most `max_wait_s`: waiting costs at most that share of the
verifier's time, merging saves a forward's fixed cost per group. A session whose returns take longer (one drafting
with a model each round) is not waited for; an unmeasured one neither.

Plain floats and dicts on the engine thread; the caller passes the clock.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

NUM_RETURNS = 5        # a session's return time: the median of its last this many
SLACK = 1.5            # wait this many times a session's return time (returns vary by a few ms)


@dataclass
class ReturnGather:
    share: float = 0.15                # of the last forward's seconds the engine may wait
    max_wait_s: float = 0.02           # ... at most (0 = never wait)
    _answered_at: dict[str, float] = field(default_factory=dict)    # sessions answered, not yet back
    _returns: dict[str, deque[float]] = field(default_factory=dict)  # each session's last return times
    _window_end: float = 0.0           # the last forward's end + its window

    def forward_done(self, answered: list[str], started: float, ended: float) -> None:
        """A forward that ran from `started` to `ended` answered the sessions `answered` (monotonic seconds)."""
        for session_id in answered:
            self._answered_at[session_id] = ended
        self._window_end = ended + min(self.max_wait_s, self.share * max(0.0, ended - started))

    def returned(self, session_id: str, submitted_at: float) -> None:
        """The session's next request was submitted at `submitted_at` (the caller's clock, when it arrived)."""
        answered = self._answered_at.pop(session_id, None)
        if answered is None:
            return
        self._returns.setdefault(session_id, deque(maxlen=NUM_RETURNS)).append(max(0.0, submitted_at - answered))

    def forget(self, session_id: str) -> None:
        self._answered_at.pop(session_id, None)
        self._returns.pop(session_id, None)

    def wait_s(self, now: float) -> float:
        """Seconds to wait before the next step: until the last of the sessions expected back within the window
        should be back (0: step now)."""
        if now >= self._window_end:
            return 0.0
        expected = [at + SLACK * statistics.median(self._returns[s]) for s, at in self._answered_at.items()
                    if s in self._returns]
        due = [t for t in expected if now < t <= self._window_end]
        return max(due) - now if due else 0.0
