"""Lossless verification of draft tokens (greedy match and speculative rejection sampling).

Notation: ``p`` = target probabilities, ``q`` = draft probabilities, ``k`` = number of
draft tokens. Row ``i`` of the target tensors is the target's distribution for the token
following (context + drafts[:i]); row ``k`` is the bonus position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specmesh.spec.sampling import inverse_cdf_index

# Residual mass at or below this is treated as zero (p == q numerically): sample from p.
_RESIDUAL_EPS = 1e-12


@dataclass(frozen=True)
class SparseDist:
    """A draft's q at one position: q(token_ids[j]) = probs[j], zero elsewhere.

    One-hot drafts (cache / n-gram) are ``SparseDist([t], [1.0])``. Lists are accepted
    and stored as tuples.
    """

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]

    def __post_init__(self) -> None:
        ids = tuple(int(t) for t in self.token_ids)
        probs = tuple(float(x) for x in self.probs)
        if len(ids) != len(probs) or not ids:
            raise ValueError(
                f"SparseDist needs equally long non-empty token_ids/probs, got {len(ids)} and {len(probs)}"
            )
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"SparseDist token_ids must be unique and >= 0, got {ids}")
        if any(not math.isfinite(x) or x < 0.0 for x in probs):
            raise ValueError(f"SparseDist probs must be finite and >= 0, got {probs}")
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "probs", probs)

    def prob(self, token_id: int) -> float:
        """q(token_id); zero outside the support."""
        for t, x in zip(self.token_ids, self.probs, strict=True):
            if t == token_id:
                return x
        return 0.0

    def dense(self, vocab_size: int) -> torch.Tensor:
        """q as a dense float64 vector [vocab_size]."""
        if max(self.token_ids) >= vocab_size:
            raise ValueError(f"SparseDist token id {max(self.token_ids)} >= vocab size {vocab_size}")
        q = torch.zeros(vocab_size, dtype=torch.float64)
        q[list(self.token_ids)] = torch.tensor(self.probs, dtype=torch.float64)
        return q


def _check_rows(target: torch.Tensor, draft_token_ids: Sequence[int], name: str) -> int:
    """Validate target [k+1, V] against k drafts; return V."""
    k = len(draft_token_ids)
    if target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(f"{name} must have shape [k+1, V] = [{k + 1}, V], got {tuple(target.shape)}")
    vocab_size = int(target.shape[1])
    if vocab_size == 0:
        raise ValueError(f"{name} has an empty vocabulary")
    for t in draft_token_ids:
        if not 0 <= int(t) < vocab_size:
            raise ValueError(f"draft token id {t} outside vocabulary [0, {vocab_size})")
    return vocab_size


def verify_greedy(target_logits: torch.Tensor, draft_token_ids: Sequence[int]) -> list[int]:
    """Greedy verification. target_logits [k+1, V].

    Accept drafts while they equal the row's argmax (ties -> lowest id), then append the
    argmax of the first non-matching row (or of row k, the bonus). Returns accepted
    drafts + exactly one target token.
    """
    _check_rows(target_logits, draft_token_ids, "target_logits")
    argmax = torch.argmax(target_logits, dim=-1).tolist()  # [k+1]
    emitted: list[int] = []
    for i, draft in enumerate(draft_token_ids):
        if int(draft) != argmax[i]:
            emitted.append(int(argmax[i]))
            return emitted
        emitted.append(int(draft))
    emitted.append(int(argmax[-1]))
    return emitted


def _sample_residual(p_row: torch.Tensor, q_row: torch.Tensor, u: float) -> int:
    """Sample from norm(max(0, p - q)) with uniform u; fall back to p if the residual has no mass.

    Rows [V] float64.
    """
    residual = (p_row - q_row).clamp_(min=0.0)
    if float(residual.sum()) <= _RESIDUAL_EPS:
        residual = p_row
    return inverse_cdf_index(residual, u)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[int],
    draft_dists: Sequence[SparseDist],
    generator: torch.Generator,
) -> list[int]:
    """Speculative (rejection) sampling, Leviathan et al. / Chen et al.

    target_probs [k+1, V] (processed by ``logits_to_probs``); draft_dists[i] is q_i.
    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) (float64; q_i(d_i) == 0 ->
    reject); on the first rejection emit a sample from norm(max(0, p_i - q_i)) and stop;
    if all are accepted emit a bonus sample from p_k. Returns accepted drafts + one token.
    """
    vocab_size = _check_rows(target_probs, draft_token_ids, "target_probs")
    if len(draft_dists) != len(draft_token_ids):
        raise ValueError(f"got {len(draft_token_ids)} draft tokens but {len(draft_dists)} draft distributions")
    p = target_probs.detach().to(device="cpu", dtype=torch.float64)  # [k+1, V]
    if not float(p.min()) >= 0.0:  # also catches NaN; zero-mass rows raise when sampled
        raise ValueError("target_probs must be non-negative and finite")
    k = len(draft_token_ids)
    # Independent uniforms drawn up front: u[i] for the accept test at draft i (as vLLM
    # does), u[k] for the one final token (residual or bonus sample).
    u = torch.rand(k + 1, generator=generator, dtype=torch.float64).tolist()
    emitted: list[int] = []
    for i, (draft, dist) in enumerate(zip(draft_token_ids, draft_dists, strict=True)):
        draft = int(draft)
        q_d = dist.prob(draft)
        if q_d > 0.0 and u[i] < float(p[i, draft]) / q_d:
            emitted.append(draft)
            continue
        emitted.append(_sample_residual(p[i], dist.dense(vocab_size), u[k]))
        return emitted
    emitted.append(inverse_cdf_index(p[k], u[k]))
    return emitted


def num_accepted(emitted: list[int]) -> int:
    """Number of accepted draft tokens in an emitted list (all but the final target token)."""
    if not emitted:
        raise ValueError("emitted must contain at least the one target token")
    return len(emitted) - 1
