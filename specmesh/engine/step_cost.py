"""What an engine step costs in seconds, measured on the steps the engine runs: the scheduler sizes a step that
carries prefill by it (specmesh/engine/step_budget.py).

Unlike `forward_cost.py` (one more token's price relative to a decode-sized forward, fitted on forwards of at most
32 tokens and no prefill), this model covers every size, prefill chunks included, in absolute seconds. A step's
cost has two parts:

    t(n, P) = base(n) + c * P

n is the step's tokens, P its attention pairs (query-key products: an item of L tokens from position s attends to
s + 1 .. s + L positions, L * s + L (L + 1) / 2 pairs), so a 512-token chunk late in a 4k prompt costs more than
the first one. base(n) is per size bucket (bucket k holds steps of 2^k .. 2^(k+1) - 1 tokens): decayed sums of the
tokens, pairs and seconds of recent steps give a bucket's mean (tokens, seconds - c * pairs), a point of base.
c (seconds per pair, >= 0) is a least-squares fit of seconds on tokens and pairs within the buckets (deviations
from each bucket's means, pooled), so steps of one size at different context lengths are what measures it, not the
difference between sizes; it is 0 until such steps differ in pairs. Between points base is interpolated linearly;
below the smallest point it is that point's seconds (a forward costs at least what the smallest one seen did);
beyond the largest it grows in proportion to n (compute-bound: conservative, so the scheduler tries larger chunks
only as it measures them). The points are made non-decreasing in n by a weighted isotonic fit (pool adjacent
violators: where a bucket costs more than a larger one, both take their weighted mean), so t is monotone in n and in P
and a bisection over a chunk's length is valid. A bucket's weight in that fit is its decayed weight times
STALE_DECAY per step observed in other buckets since its own last one: a bucket measured once, long ago, gives way to
the buckets the engine runs now. (A plain running maximum let one cold step rule: a stack's first 3-token verify,
83 ms beside a draft model's warm-up against ~45 ms for the 5-token steps that followed, priced every step of 5 tokens
or more at 83 ms or more for the rest of the run, so the steps beside a long prompt carried only the 4-token floor of
prefill: bench.stall's time to first token 2.16x alone, against 1.68-1.93x in runs without such a step.) Plain
floats, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.95           # weight an old step keeps per newer step of the same bucket (memory ~20 steps)
MAX_BUCKET = 16        # steps of 2^16 tokens and more share the last bucket
STALE_DECAY = 0.98     # a bucket's weight in the monotone fit, per step of another bucket since its own last
MIN_FIT_WEIGHT = 1e-9  # stale buckets keep a little weight (a pool of them still averages by their own weights)
_SUMS = ("w", "n", "p", "t", "nn", "np", "pp", "nt", "pt")   # decayed sums per bucket: weight, x, x*y products


def bucket_of(num_tokens: int) -> int:
    return min(MAX_BUCKET, num_tokens.bit_length() - 1)


def attention_pairs(start_pos: int, num_tokens: int) -> int:
    """Query-key pairs of `num_tokens` tokens run from position `start_pos` (causal: token i sees i + 1 positions)."""
    return num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2


def monotone_points(means: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """(tokens, seconds, weight) in rising tokens -> (tokens, seconds) non-decreasing in seconds: the weighted
    isotonic fit (pool adjacent violators). Adjacent points that fall as tokens rise are pooled into their weighted
    mean until none does, so the heavier (recent, often measured) side decides where they meet."""
    pools: list[tuple[float, float, int]] = []          # (weighted mean seconds, weight, points pooled)
    for _, seconds, weight in means:
        value, total, count = seconds, weight, 1
        while pools and pools[-1][0] > value:
            prev_value, prev_total, prev_count = pools.pop()
            value = (prev_value * prev_total + value * total) / (prev_total + total)
            total, count = prev_total + total, prev_count + count
        pools.append((value, total, count))
    fitted = [value for value, _, count in pools for _ in range(count)]
    return [(tokens, value) for (tokens, _, _), value in zip(means, fitted, strict=True)]


@dataclass
class _Buckets:
    sums: dict[str, list[float]] = field(default_factory=lambda: {k: [0.0] * (MAX_BUCKET + 1) for k in _SUMS})
    pair_s: float = 0.0                                                   # c: seconds per attention pair
    points: list[tuple[float, float]] = field(default_factory=list)   # (mean tokens, fitted base seconds), rising n
    num_steps: int = 0                                                # steps observed, all buckets
    last_step: list[int] = field(default_factory=lambda: [0] * (MAX_BUCKET + 1))   # num_steps at a bucket's last

    def add(self, num_tokens: int, num_pairs: int, seconds: float) -> None:
        k, n, p, t = bucket_of(num_tokens), float(num_tokens), float(num_pairs), seconds
        for name, value in zip(_SUMS, (1.0, n, p, t, n * n, n * p, p * p, n * t, p * t), strict=True):
            self.sums[name][k] = DECAY * self.sums[name][k] + value
        self.num_steps += 1
        self.last_step[k] = self.num_steps
        self.pair_s = self._fit_pair_seconds()
        means = []                  # (mean tokens, mean base seconds, weight in the fit) per measured bucket
        s = self.sums
        for b, (w, tokens, pairs, secs) in enumerate(zip(s["w"], s["n"], s["p"], s["t"], strict=True)):
            if w > 0:
                fresh = STALE_DECAY ** (self.num_steps - self.last_step[b])
                means.append((tokens / w, (secs - self.pair_s * pairs) / w, max(MIN_FIT_WEIGHT, w * fresh)))
        self.points = monotone_points(means)

    def _fit_pair_seconds(self) -> float:
        """c of t = a_k + b n + c P by pooled within-bucket least squares (2x2 normal equations); 0 when the steps
        do not vary in pairs apart from tokens."""
        s = self.sums
        snn = snp = spp = snt = spt = 0.0
        for k, w in enumerate(s["w"]):
            if w <= 0:
                continue
            n, p, t = s["n"][k], s["p"][k], s["t"][k]
            snn += s["nn"][k] - n * n / w
            snp += s["np"][k] - n * p / w
            spp += s["pp"][k] - p * p / w
            snt += s["nt"][k] - n * t / w
            spt += s["pt"][k] - p * t / w
        det = snn * spp - snp * snp
        if spp <= 0 or det <= 1e-9 * max(snn * spp, 1e-300):   # no spread in pairs beyond what tokens explain
            return 0.0
        return max(0.0, (snn * spt - snp * snt) / det)

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
    """Measured seconds of a step by its size in tokens and its attention pairs, per torch thread count."""

    def __init__(self) -> None:
        self._by_threads: dict[int, _Buckets] = {}

    def observe(self, num_tokens: int, num_threads: int, seconds: float, num_pairs: int = 0) -> None:
        """A completed forward of `num_tokens` tokens (`num_pairs` attention pairs) on `num_threads` threads took
        `seconds`."""
        if num_tokens > 0 and seconds > 0:
            self._by_threads.setdefault(num_threads, _Buckets()).add(num_tokens, num_pairs, seconds)

    def seconds(self, num_tokens: int, num_threads: int) -> float | None:
        """Estimated seconds of a step of `num_tokens` tokens apart from its attention pairs (add
        `pair_seconds` x pairs); None while no step ran on `num_threads` threads."""
        buckets = self._by_threads.get(num_threads)
        if buckets is None or not buckets.points or num_tokens <= 0:
            return None
        return buckets.at(num_tokens)

    def pair_seconds(self, num_threads: int) -> float:
        """Seconds one attention pair adds to a step on `num_threads` threads (0 until measured)."""
        buckets = self._by_threads.get(num_threads)
        return buckets.pair_s if buckets is not None else 0.0
