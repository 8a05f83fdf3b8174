"""What a draft-length controller (gateway/adaptive.py) has learned, as decayed sums that outlive its request:
the learned priors (gateway/learned_priors.py) blend finished requests' memories and seed new requests from them."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ControllerMemory:
    """What a controller has learned, as its decayed sums: a finished request's, or several blended
    (gateway/learned_priors.py). `rounds` is the decayed number of rounds behind them (the verify line's weight).
    rtt_s and token_cost are estimates, not sums: blending keeps the newest known one."""
    succ: tuple[float, ...]
    fail: tuple[float, ...]
    draft_time: float
    draft_tokens: float
    verify: tuple[float, float, float, float, float]    # DecayedLine sums (w, sx, sxx, st, sxt)
    rtt_s: float | None
    token_cost: float
    alt_nodes: float
    alt_hits: float
    free_tokens: int = 1                                 # the verify sums' x = tokens beyond these (verify_cost.py)

    @property
    def rounds(self) -> float:
        return self.verify[0]

    def scaled(self, factor: float) -> ControllerMemory:
        """Every sum times `factor` (the same means, `factor` times the evidence)."""
        return replace(self, succ=tuple(factor * s for s in self.succ), fail=tuple(factor * f for f in self.fail),
                       draft_time=factor * self.draft_time, draft_tokens=factor * self.draft_tokens,
                       verify=tuple(factor * v for v in self.verify),   # type: ignore[arg-type]
                       alt_nodes=factor * self.alt_nodes, alt_hits=factor * self.alt_hits)

    def plus(self, newer: ControllerMemory) -> ControllerMemory:
        """The evidence of both (sums added; positions padded to the longer); estimates from `newer` when known."""
        def add(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
            n = max(len(a), len(b))
            return tuple((a[i] if i < len(a) else 0.0) + (b[i] if i < len(b) else 0.0) for i in range(n))
        return ControllerMemory(
            add(self.succ, newer.succ), add(self.fail, newer.fail), self.draft_time + newer.draft_time,
            self.draft_tokens + newer.draft_tokens, add(self.verify, newer.verify),   # type: ignore[arg-type]
            newer.rtt_s if newer.rtt_s is not None else self.rtt_s, newer.token_cost or self.token_cost,
            self.alt_nodes + newer.alt_nodes, self.alt_hits + newer.alt_hits, newer.free_tokens)
