"""A decayed least-squares line through points (x, t): every new point weighs 1 and older ones `decay` times less
per point added. Plain floats; the gateway fits verify time against the tokens a verify pays for with it
(gateway/adaptive.py)."""

from __future__ import annotations


class DecayedLine:
    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = self.sx = self.sxx = self.st = self.sxt = 0.0

    def add(self, x: float, t: float) -> None:
        d = self.decay
        self.w, self.sx, self.sxx = d * self.w + 1, d * self.sx + x, d * self.sxx + x * x
        self.st, self.sxt = d * self.st + t, d * self.sxt + x * t

    def moments(self) -> tuple[float, float, float] | None:
        """(mean x, mean t, variance of x) of the weighted points; None before the first."""
        if self.w <= 0:
            return None
        mean_x, mean_t = self.sx / self.w, self.st / self.w
        return mean_x, mean_t, self.sxx / self.w - mean_x * mean_x

    def slope(self) -> float:
        """The least-squares slope dt/dx (only meaningful where the variance of x is not ~0)."""
        mean_x, mean_t, var_x = self.moments() or (0.0, 0.0, 0.0)
        return (self.sxt / self.w - mean_x * mean_t) / var_x
