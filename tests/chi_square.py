"""Chi-square goodness of fit of sampled counts against a distribution, shared by the sampling tests."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

# Draws from a seeded torch.Generator give the same counts every run, so 1e-3 cannot flake there.
MIN_PVALUE = 1e-3
# Unseeded draws through the full stack differ every run: a test rejects a correct sampler at exactly its threshold's
# rate, and CI at the sum over such asserts. At 1e-6 that is negligible, while a real fault keeps failing: leaving out
# min_p (total variation 0.16 in test_api_honesty_e2e) gives p < 1e-30 from 360 samples.
MIN_PVALUE_UNSEEDED = 1e-6


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
