"""What an engine step of n tokens costs in seconds, measured on the steps the engine runs: the scheduler sizes a
step that carries prefill by it (specmesh/engine/step_budget.py).

Unlike `forward_cost.py` (one more token's price relative to a decode-sized forward, fitted on forwards of at most
32 tokens and no prefill), this model covers every size, prefill chunks included, in absolute seconds: per thread
count and per size bucket (bucket k holds steps of 2^k .. 2^(k+1) - 1 tokens) it keeps decayed sums of the tokens
and seconds of recent steps, so a bucket's mean (tokens, seconds) is a point of t(n). Between points t is
interpolated linearly; below the smallest point it is that point's seconds (a forward costs at least what the
smallest one seen did); beyond the largest it grows in proportion to n (compute-bound: conservative, so the
scheduler tries larger chunks only as it measures them). The points are made non-decreasing in n (a noisy bucket
never makes more tokens look cheaper), so t is monotone and a bisection over n is valid. Plain floats, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.95           # weight an old step keeps per newer step of the same bucket (memory ~20 steps)
MAX_BUCKET = 16        # steps of 2^16 tokens and more share the last bucket


def bucket_of(num_tokens: int) -> int:
    return min(MAX_BUCKET, num_tokens.bit_length() - 1)


@dataclass
class _Buckets:
    weight: list[float] = field(default_factory=lambda: [0.0] * (MAX_BUCKET + 1))
    tokens: list[float] = field(default_factory=lambda: [0.0] * (MAX_BUCKET + 1))
    seconds: list[float] = field(default_factory=lambda: [0.0] * (MAX_BUCKET + 1))
    points: list[tuple[float, float]] = field(default_factory=list)   # (mean tokens, mean seconds), rising n

    def add(self, num_tokens: int, seconds: float) -> None:
        k = bucket_of(num_tokens)
        self.weight[k] = DECAY * self.weight[k] + 1.0
        self.tokens[k] = DECAY * self.tokens[k] + num_tokens
        self.seconds[k] = DECAY * self.seconds[k] + seconds
        points, floor = [], 0.0
        for w, n, t in zip(self.weight, self.tokens, self.seconds, strict=True):
            if w > 0:
                floor = max(floor, t / w)
                points.append((n / w, floor))
        self.points = points

    def at(self, num_tokens: int) -> float:
        points = self.points
        n0, t0 = points[0]
        if num_tokens <= n0:
            return t0
        for n1, t1 in points[1:]:
            if num_tokens <= n1:
                return t0 + (t1 - t0) * (num_tokens - n0) / (n1 - n0)
            n0, t0 = n1, t1
        return t0 * num_tokens / n0


class StepCost:
    """Measured seconds of a step by its size in tokens, per torch thread count."""

    def __init__(self) -> None:
        self._by_threads: dict[int, _Buckets] = {}

    def observe(self, num_tokens: int, num_threads: int, seconds: float) -> None:
        """A completed forward of `num_tokens` tokens on `num_threads` threads took `seconds`."""
        if num_tokens > 0 and seconds > 0:
            self._by_threads.setdefault(num_threads, _Buckets()).add(num_tokens, seconds)

    def seconds(self, num_tokens: int, num_threads: int) -> float | None:
        """Estimated seconds of a step of `num_tokens` tokens; None while no step ran on `num_threads` threads."""
        buckets = self._by_threads.get(num_threads)
        if buckets is None or not buckets.points or num_tokens <= 0:
            return None
        return buckets.at(num_tokens)
