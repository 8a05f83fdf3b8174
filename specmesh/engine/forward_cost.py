"""An engine's own measure of what one more token costs in a forward: the verifier reports it to the gateway,
which prices drafts by it, and both model services price their prompt-lookup guesses by it (specmesh/engine/guesses.py).

Per thread count (a step that decodes ahead on one thread beside the draft model costs differently from a verify on
two), decayed sums per forward size n (tokens in the forward) of recent forwards' seconds, and a least-squares fit of

    t(n) = a + b * max(0, n - F),    token_cost = b / a    (one more token beyond F, relative to a forward of up to F)

F (`free_tokens`) is the number of tokens a forward takes for about the price of one, picked from FREE_CANDIDATES as
the one whose line fits best: a larger F must cut the fit's squared error by a third. Measured, Qwen2.5-1.5B int4 on
an AVX2-only Zen 3 core: 100 ms for 1 to 4 tokens, 140 for 5, 188 for 8 (the int4 kernel unpacks and streams each
weight block once per 4 rows, and 4 rows of integer dot products fit in the time the weights take to stream): F = 4.
On a Zen 1 core, whose AVX2 units are half as wide, the same kernel is compute-bound: 116 ms at 1 token, 273 at 4,
F = 1. With F = 1 the line is t(n) = a + b * (n - 1), a the one-token forward.

Only verify-sized forwards count (n <= MAX_TOKENS; the engine leaves out any forward that computes a prompt's KV):
a prefill is compute-bound all the way, while a decode-sized forward streams the weights once and pays for extra
tokens only beyond that, so prefills would tilt the line. Until the forwards seen have some spread in max(0, n - F)
the slope is unknown (0). Plain floats, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOKENS = 32        # forwards with more tokens are not verify-sized
DECAY = 0.98           # weight an old forward keeps per new one (memory ~50 forwards)
MIN_VARIANCE = 0.2     # spread in x = max(0, n - F) (tokens squared) below which the slope is not identifiable
MAX_COST = 2.0         # a token costing more than two one-token forwards is noise (e.g. a preempted step)
FREE_CANDIDATES = (1, 2, 4, 8)
MIN_SIZE_WEIGHT = 0.5  # decayed forwards of one size behind its own mean (`ForwardCost.seconds`)
BETTER_FIT = 2 / 3     # a larger F is taken when its squared error is below this share of the smaller one's


@dataclass(frozen=True)
class Fit:
    token_cost: float      # b / a (0 = unknown)
    free_tokens: int       # F
    sse: float             # weighted squared error of the fit


UNKNOWN = Fit(0.0, 1, 0.0)


class _SizeSums:
    """Decayed weight, sum of t and of t^2 per forward size n = 1..MAX_TOKENS."""

    def __init__(self) -> None:
        self.w = [0.0] * (MAX_TOKENS + 1)
        self.st = [0.0] * (MAX_TOKENS + 1)
        self.stt = [0.0] * (MAX_TOKENS + 1)

    def add(self, n: int, t: float) -> None:
        for sums in (self.w, self.st, self.stt):
            for i, v in enumerate(sums):
                sums[i] = DECAY * v
        self.w[n] += 1.0
        self.st[n] += t
        self.stt[n] += t * t

    def mean(self, n: int) -> float | None:
        return self.st[n] / self.w[n] if 0 < n <= MAX_TOKENS and self.w[n] >= MIN_SIZE_WEIGHT else None

    def fit(self, free: int) -> Fit | None:
        """The weighted least-squares line in x = max(0, n - free); None while x has too little spread."""
        w = sx = sxx = st = sxt = stt = 0.0
        for n in range(1, MAX_TOKENS + 1):
            if self.w[n] <= 0:
                continue
            x = max(0, n - free)
            w, sx, sxx = w + self.w[n], sx + self.w[n] * x, sxx + self.w[n] * x * x
            st, sxt, stt = st + self.st[n], sxt + x * self.st[n], stt + self.stt[n]
        if w <= 0:
            return None
        mean_x, mean_t = sx / w, st / w
        var_x = sxx / w - mean_x * mean_x
        if var_x < MIN_VARIANCE:
            return None
        b = max(0.0, (sxt / w - mean_x * mean_t) / var_x)
        a = mean_t - b * mean_x
        sse = max(0.0, stt - 2 * a * st - 2 * b * sxt + a * a * w + 2 * a * b * sx + b * b * sxx)
        return Fit(min(MAX_COST, b / a) if a > 0 else 0.0, free, sse)


def best_fit(sums: _SizeSums) -> Fit:
    best: Fit | None = None
    for free in FREE_CANDIDATES:
        fit = sums.fit(free)
        if fit is not None and (best is None or fit.sse < BETTER_FIT * best.sse):
            best = fit
    return best or UNKNOWN


class ForwardCost:
    """token_cost and free_tokens per thread count, fed every forward the engine completes."""

    def __init__(self) -> None:
        self._sums: dict[int, _SizeSums] = {}
        self._fits: dict[int, Fit] = {}

    def observe(self, num_tokens: int, num_threads: int, seconds: float) -> None:
        if 0 < num_tokens <= MAX_TOKENS and seconds > 0:
            sums = self._sums.setdefault(num_threads, _SizeSums())
            sums.add(num_tokens, seconds)
            self._fits[num_threads] = best_fit(sums)

    def fit(self, num_threads: int) -> Fit:
        """At `num_threads`: one more token's cost beyond the free ones relative to a forward of up to F tokens
        (0 = not measured yet), and F."""
        return self._fits.get(num_threads, UNKNOWN)

    def token_cost(self, num_threads: int) -> float:
        return self.fit(num_threads).token_cost

    def seconds(self, num_threads: int, num_tokens: int) -> float | None:
        """The recent forwards of exactly `num_tokens` tokens on `num_threads`: their mean seconds (None: too few).
        Where the line is not the kernel's shape, this is: the int4 AVX-512 kernel on 2 threads takes 68 ms for 8
        rows, 82 for 9 (a row past its 8-row tile), 89 for 10, 121 for 16."""
        sums = self._sums.get(num_threads)
        return sums.mean(num_tokens) if sums is not None else None
