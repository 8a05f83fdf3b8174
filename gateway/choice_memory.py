"""What a ProposerChoice (gateway/suffix_choice.py) learned, as plain sums, to start later requests from
(gateway/learned_priors.py): scaled to a weight, merged with newer memories, or without one proposer's cost."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gateway.controller_memory import ControllerMemory


@dataclass(frozen=True)
class ChoiceMemory:
    """What a ProposerChoice learned (its decayed sums), to start later requests from (gateway/learned_priors.py).
    Sums are (total, weight) pairs; a calibration is (pooled total, pooled weight, accepted per depth, predicted per
    depth). `rounds`: the decayed number of verified rounds behind them."""
    rounds: float
    verify_base: tuple[float, float]
    verify_slope: float
    costs: tuple[tuple[str, float, float], ...]
    calibrations: tuple[tuple[str, float, float, tuple[float, ...], tuple[float, ...]], ...]
    model: ControllerMemory | None = field(default=None)
    free_tokens: int = 1

    def scaled(self, factor: float) -> ChoiceMemory:
        return ChoiceMemory(
            factor * self.rounds, (factor * self.verify_base[0], factor * self.verify_base[1]), self.verify_slope,
            tuple((p, factor * t, factor * w) for p, t, w in self.costs),
            tuple((p, factor * t, factor * w, tuple(factor * a for a in acc), tuple(factor * x for x in pred))
                  for p, t, w, acc, pred in self.calibrations),
            self.model.scaled(factor) if self.model else None, self.free_tokens)

    def costs_only(self) -> ChoiceMemory:
        """The same costs (the verify line, each proposer's round cost) without what was learned of acceptance (the
        suffix calibrations, the model's draft-length sums): costs are this deployment's, the same whether a request
        samples or not; acceptance is not (gateway/learned_priors.py)."""
        return dataclasses.replace(self, calibrations=(), model=None)

    def without_cost(self, proposer: str) -> ChoiceMemory:
        """The same memory with `proposer`'s round cost unmeasured (gateway/learned_priors.py: exploration)."""
        return dataclasses.replace(self, costs=tuple(c for c in self.costs if c[0] != proposer))

    def plus(self, newer: ChoiceMemory) -> ChoiceMemory:
        def merge(a: dict[str, tuple[Any, ...]], b: dict[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:  # sums
            out = dict(a)
            for key, value in b.items():
                out[key] = value if key not in out else tuple(_add(x, y) for x, y in zip(out[key], value,
                                                                                          strict=True))
            return out
        costs = merge({p: (t, w) for p, t, w in self.costs}, {p: (t, w) for p, t, w in newer.costs})
        cals = merge({c[0]: c[1:] for c in self.calibrations}, {c[0]: c[1:] for c in newer.calibrations})
        model = newer.model if self.model is None else self.model if newer.model is None else \
            self.model.plus(newer.model)
        return ChoiceMemory(self.rounds + newer.rounds,
                            (self.verify_base[0] + newer.verify_base[0], self.verify_base[1] + newer.verify_base[1]),
                            newer.verify_slope, tuple((p, *v) for p, v in costs.items()),
                            tuple((p, *v) for p, v in cals.items()), model, newer.free_tokens)


def _add(x: float | tuple[float, ...], y: float | tuple[float, ...]) -> float | tuple[float, ...]:
    if isinstance(x, tuple):
        return tuple(a + b for a, b in zip(x, y, strict=True))   # type: ignore[arg-type]
    return x + y                                                  # type: ignore[operator]
