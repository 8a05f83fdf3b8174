"""The verifier's own measure of what one more token costs in a forward, for the gateway's draft pricing.

Per thread count (a step that decodes ahead on one thread beside the draft model costs differently from a verify on
two), a decayed least-squares line through (tokens beyond the free ones, seconds) of recent forwards:

    t(n) = a + b * max(0, n - F),    token_cost = b / a    (one more token, relative to a forward of up to F tokens)

F (`free_tokens`) is the matmul kernel's row tile: the int4 kernel unpacks and streams each weight block once per F
rows, so a forward of up to F tokens costs about what one token does (1.5B int4, AVX2, 1 thread: 100 ms for 1 to 4
tokens, 140 for 5, 188 for 8). F = 1 for the other numerics: then t(n) = a + b * (n - 1), a one-token forward.

Only verify-sized forwards count (n <= MAX_TOKENS; the engine leaves out any forward that computes a prompt's KV):
a prefill is compute-bound all the way, while a decode-sized forward streams the weights once and pays for extra
tokens only beyond that, so prefills would tilt the line. Until the forwards seen have some spread in n the slope is
unknown (0). Plain floats, no clock.
"""

from __future__ import annotations

from specmesh.decayed_line import DecayedLine

MAX_TOKENS = 32        # forwards with more tokens are not verify-sized
DECAY = 0.98           # weight an old forward keeps per new one (memory ~50 forwards)
MIN_VARIANCE = 0.2     # spread in n (tokens squared) below which the slope is not identifiable
MAX_COST = 2.0         # a token costing more than two one-token forwards is noise (e.g. a preempted step)


def _token_cost(line: DecayedLine) -> float:
    """b / a of the line t(x) = a + b * x (x = tokens beyond the free ones); 0 while x has too little spread."""
    moments = line.moments()
    if moments is None or moments[2] < MIN_VARIANCE:
        return 0.0
    mean_x, mean_t, _ = moments
    b = max(0.0, line.slope())
    base = mean_t - b * mean_x                           # t(0) = a: a forward of up to F tokens
    return min(MAX_COST, b / base) if base > 0 else 0.0


class ForwardCost:
    """token_cost per thread count, fed every forward the engine completes."""

    def __init__(self, free_tokens: int = 1) -> None:
        if free_tokens < 1:
            raise ValueError(f"free_tokens must be >= 1, got {free_tokens}")
        self.free_tokens = free_tokens
        self._lines: dict[int, DecayedLine] = {}

    def observe(self, num_tokens: int, num_threads: int, seconds: float) -> None:
        if 0 < num_tokens <= MAX_TOKENS and seconds > 0:
            excess = max(0, num_tokens - self.free_tokens)
            self._lines.setdefault(num_threads, DecayedLine(DECAY)).add(excess, seconds)

    def token_cost(self, num_threads: int) -> float:
        """One more token's cost (beyond the free ones) relative to a forward of up to `free_tokens` tokens at
        `num_threads` (0 = not measured yet)."""
        line = self._lines.get(num_threads)
        return _token_cost(line) if line is not None else 0.0
