"""Chi-square goodness of fit of sampled counts against a distribution, shared by the sampling tests."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

MIN_PVALUE = 1e-3


def fit(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(chi-square p-value, total-variation distance) of counts [V] against probs [V]."""
    probs = probs.to(torch.float64)
    probs = probs / probs.sum()
    n = float(counts.sum())
    tv = 0.5 * float((counts / n - probs).abs().sum())
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0, tv  # mass outside the support of p is impossible
    if int(support.sum()) == 1:
        return 1.0, tv
    expected = probs[support] / probs[support].sum() * n
    result = chisquare(counts[support].numpy(), expected.numpy())
    return float(result.pvalue), tv
