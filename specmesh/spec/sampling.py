"""Sampling math shared by the target (verifier) and the draft model.

Notation follows the speculative decoding literature: ``p`` is the target
distribution and ``q`` the draft distribution. The SAME processing
(:func:`logits_to_probs`) must be applied to target and draft logits so that
rejection sampling recovers exactly the processed target distribution.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

import torch

# Temperatures below this are treated as greedy (same convention as vLLM).
_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling configuration."""

    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 -> disabled
    seed: int | None = None
    min_p: float = 0.0  # in [0, 1]; 0 -> disabled
    repetition_penalty: float = 1.0  # in (0, 100]; 1 -> disabled
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids unique

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise ValueError("logit_bias token ids must be unique and >= 0")
        if any(not (math.isfinite(b) and -100.0 <= b <= 100.0) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def is_seeded(self) -> bool:
        """A seeded sampled request: its tokens come from specmesh/spec/seeded.py (reproducible whatever the drafts)."""
        return self.seed is not None and not self.is_greedy

    @property
    def needs_context(self) -> bool:
        """The logits are adjusted by the tokens before each position (repetition_penalty)."""
        return self.repetition_penalty != 1.0


# Top-k / top-p rank tokens by probability; a full sort of a 151,936-token row took ~18 ms on one CPU core (about half
# a decode forward of the real target, for every sampled row of a verify and every drafted token; 2-core Zen 4). The
# ranking that decides a row almost always lies in its most likely few hundred tokens: these are ranked first (~3-4 ms
# a row with the softmax), and only a row whose nucleus reaches past them is sorted whole.
NUM_CANDIDATES = 1024


def _filter_top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p and renormalize. probs [N, V] float64.

    Tokens rank by probability, ties by the lowest token id (a stable descending sort). top-k keeps the first k;
    top-p then keeps a token iff the mass ranked above it (renormalized over what top-k kept) is < top_p, the
    smallest prefix whose mass reaches top_p. The most likely token always stays."""
    num_vocab = probs.shape[-1]
    top_k = top_k if 0 < top_k < num_vocab else 0
    mask = torch.zeros_like(probs, dtype=torch.bool)
    for row in range(probs.shape[0]):
        kept_ids = _top_ranked(probs[row], top_k, top_p)
        mask[row, kept_ids if kept_ids is not None else _kept_by_full_sort(probs[row], top_k, top_p)] = True
    filtered = torch.where(mask, probs, torch.zeros_like(probs))
    return filtered / filtered.sum(dim=-1, keepdim=True)


def _keep_ranked(sorted_p: torch.Tensor, top_k: int, top_p: float, total: float) -> torch.Tensor:
    """Which of a row's first len(sorted_p) ranked probabilities stay (bool [n]); total: top-p's normalizer."""
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    if top_p < 1.0:
        kept = sorted_p * keep / total
        # Exclusive cumulative mass: keep a token iff the mass ranked above it is < top_p,
        # which yields the smallest prefix whose mass is >= top_p.
        mass_before = torch.cumsum(kept, dim=-1) - kept
        keep &= mass_before < top_p
    keep[0] = True
    return keep


def _top_ranked(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """The token ids a row keeps, from its NUM_CANDIDATES (or top_k) most likely tokens and every token tied with the
    last of them, ranked exactly as the full sort ranks them; None when the tokens past them could still stay (no
    top-k, and the candidates' mass stays below top_p). probs [V] float64."""
    num_vocab = probs.shape[-1]
    wanted = max(top_k, NUM_CANDIDATES)
    if wanted >= num_vocab:
        return None
    threshold = torch.topk(probs, wanted, sorted=False).values.min()
    candidate_ids = torch.nonzero(probs >= threshold).flatten()        # ascending ids: ties stay in id order
    candidate_p = probs[candidate_ids]
    order = torch.sort(candidate_p, descending=True, stable=True).indices
    sorted_p, sorted_ids = candidate_p[order], candidate_ids[order]
    total = float(sorted_p[:top_k].sum()) if top_k else float(probs.sum())
    keep = _keep_ranked(sorted_p, top_k, top_p, total)
    if not top_k and bool(keep[-1]):          # the nucleus may go on past the candidates
        return None
    return sorted_ids[keep]


def _kept_by_full_sort(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The token ids a row keeps, ranking the whole vocabulary. probs [V] float64."""
    # Stable descending sort: among equal probabilities the lowest token id ranks first.
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    total = float(sorted_p[:top_k].sum()) if top_k else float(sorted_p.sum())
    return order[_keep_ranked(sorted_p, top_k, top_p, total)]


def _filter_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Zero out tokens below min_p times the row's most likely token and renormalize. probs [N, V] float64."""
    keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values     # the most likely token always stays
    filtered = torch.where(keep, probs, torch.zeros_like(probs))
    return filtered / filtered.sum(dim=-1, keepdim=True)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] (any float dtype) -> processed probabilities [N, V] float32.

    Temperature, then top-k, then top-p (nucleus), then min-p, then renormalization. Greedy
    params give a one-hot at ``torch.argmax`` (ties -> lowest token id). repetition_penalty
    and logit_bias act on the logits before this (specmesh/spec/logit_transforms.py).
    """
    if logits.dim() != 2 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [N, V] with V > 0, got {tuple(logits.shape)}")
    if params.is_greedy:
        out = torch.zeros(logits.shape, dtype=torch.float32)
        return out.scatter_(-1, torch.argmax(logits, dim=-1, keepdim=True).cpu(), 1.0)
    scaled = logits.detach().to(device="cpu", dtype=torch.float64) / params.temperature
    probs = torch.softmax(scaled, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("logits produce non-finite probabilities (NaN/+inf or an all -inf row)")
    if params.top_k > 0 or params.top_p < 1.0:
        probs = _filter_top_k_top_p(probs, params.top_k, params.top_p)
    if params.min_p > 0.0:
        probs = _filter_min_p(probs, params.min_p)
    return probs.to(torch.float32)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (a random seed if None)."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def uniform(generator: torch.Generator) -> float:
    """One float64 uniform draw in [0, 1) from ``generator``."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def inverse_cdf_index(weights: torch.Tensor, u: float) -> int:
    """Index j with cdf[j-1] <= u * total < cdf[j] for non-negative float64 weights [V].

    Zero-weight entries are never returned; ``u`` is a uniform draw in [0, 1). Negative
    weights are NOT checked here (callers do it); zero / non-finite total mass raises.
    """
    cdf = torch.cumsum(weights, dim=0)  # [V]
    total = float(cdf[-1])
    if not (math.isfinite(total) and total > 0.0):
        raise ValueError(f"weights must be finite with positive mass, got total {total}")
    index = int(torch.searchsorted(cdf, u * total, right=True))
    if index >= weights.numel():  # u * total rounded up to total: take the last positive entry
        index = int(torch.nonzero(weights > 0)[-1, 0])
    return index


def sample_categorical(weights: torch.Tensor, generator: torch.Generator) -> int:
    """Draw an index from non-negative (unnormalized) weights [V] by exact inverse-CDF.

    Uses one uniform from ``generator``; equivalent in distribution to
    ``torch.multinomial(weights, 1)`` but much cheaper for a single draw (and for large V).
    """
    if weights.dim() != 1 or weights.numel() == 0:
        raise ValueError(f"weights must have shape [V] with V > 0, got {tuple(weights.shape)}")
    w = weights.detach().to(device="cpu", dtype=torch.float64)
    if not float(w.min()) >= 0.0:  # also catches NaN
        raise ValueError("weights must be non-negative")
    return inverse_cdf_index(w, uniform(generator))


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from probs [V] (see :func:`sample_categorical`)."""
    return sample_categorical(probs, generator)


def sparsify(probs: torch.Tensor, max_entries: int) -> tuple[list[int], list[float]]:
    """probs [V] -> (token_ids, probs) of the top ``max_entries`` nonzero entries, renormalized.

    This truncated q is what goes over the wire; the draft must sample from it
    (:func:`sample_sparse`) so that verification stays exact. Entries are ordered by
    decreasing probability (ties -> lowest token id first).
    """
    if probs.dim() != 1:
        raise ValueError(f"probs must have shape [V], got {tuple(probs.shape)}")
    if max_entries < 1:
        raise ValueError(f"max_entries must be >= 1, got {max_entries}")
    p64 = probs.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(p64).all()) or bool((p64 < 0).any()):
        raise ValueError("probs must be finite and non-negative")
    sorted_p, order = torch.sort(p64, descending=True, stable=True)
    n = min(max_entries, int((sorted_p > 0).sum().item()))
    if n == 0:
        raise ValueError("probs has no nonzero entries")
    top = sorted_p[:n]
    top = top / top.sum()
    return [int(t) for t in order[:n].tolist()], [float(x) for x in top.tolist()]


def sample_sparse(token_ids: list[int], token_probs: list[float], generator: torch.Generator) -> int:
    """Draw one token id from a sparse distribution (ids with their probabilities)."""
    if len(token_ids) != len(token_probs) or not token_ids:
        raise ValueError(
            f"token_ids and token_probs must be non-empty and equally long, got {len(token_ids)} and {len(token_probs)}"
        )
    if any(not math.isfinite(x) or x < 0.0 for x in token_probs):
        raise ValueError(f"token_probs must be finite and >= 0, got {token_probs}")
    cdf = list(itertools.accumulate(float(x) for x in token_probs))
    if cdf[-1] <= 0.0:
        raise ValueError("token_probs has no positive mass")
    index = bisect.bisect_right(cdf, uniform(generator) * cdf[-1])
    if index >= len(cdf):  # rounding at the top end: take the last positive entry
        index = max(j for j, x in enumerate(token_probs) if x > 0.0)
    return int(token_ids[index])
