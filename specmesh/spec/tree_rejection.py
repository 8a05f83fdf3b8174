"""Lossless verification of a token tree (greedy walk and multi-candidate rejection sampling).

Notation as in `specmesh/spec/rejection.py` (the chain oracle): ``p`` = target probabilities, ``q`` = draft
probabilities. A tree has n nodes (`specmesh/spec/tree.py`): `token_ids[i]`, `parents[i]`. Row 0 of the target tensors
is the target's distribution after the root (the pending token), row i + 1 the distribution after node i's path.

Greedy: the accepted path is the longest root-to-node path whose every token equals the target's argmax after its
parent path (argmax ties -> lowest id, as in the chain); then the argmax of the row where the path ends.

Sampling (recursive rejection sampling, SpecInfer / multi-draft speculative sampling): at the current node with
target p_1 = p, try its children x_1, x_2, ... in order; accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); on
rejection p_{i+1} = norm(max(0, p_i - q_i)). An accepted child becomes the current node; when every child is
rejected (or there is none) one token is sampled from the current p_i and the walk ends. One-hot candidates have
q_i = delta(x_i). The output is distributed exactly as the target's whenever each child is an independent draw from
its q_i given its path (or a deterministic candidate). Uniforms: u[i] for node i's test, u[n] for the final token,
drawn up front, so a chain consumes the generator exactly like `rejection_sample` and emits the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.spec.rejection import SparseDist
from specmesh.spec.sampling import inverse_cdf_index
from specmesh.spec.tree import ROOT, check_parents, children, path_to

# Residual mass at or below this is treated as zero (p == q numerically): keep the current p (as the chain does).
_RESIDUAL_EPS = 1e-12


def _check(target: torch.Tensor, token_ids: Sequence[int], parents: Sequence[int], name: str) -> int:
    """Validate target [n+1, V] against an n-node tree; return V."""
    n = len(token_ids)
    check_parents(parents, n)
    if target.dim() != 2 or target.shape[0] != n + 1:
        raise ValueError(f"{name} must have shape [n+1, V] = [{n + 1}, V], got {tuple(target.shape)}")
    vocab_size = int(target.shape[1])
    if vocab_size == 0 or any(not 0 <= int(t) < vocab_size for t in token_ids):
        raise ValueError(f"tree token ids must be in [0, {vocab_size})")
    return vocab_size


def verify_tree_greedy(target_logits: torch.Tensor, token_ids: Sequence[int],
                       parents: Sequence[int]) -> tuple[list[int], int]:
    """target_logits [n+1, V] -> (accepted node indices in path order, the target's next token).

    The accepted path ends at the deepest node whose whole path matches the target's argmax (the lowest index
    among equally deep ones: duplicate candidates may hold different subtrees)."""
    _check(target_logits, token_ids, parents, "target_logits")
    argmax = torch.argmax(target_logits, dim=-1).tolist()      # [n+1]
    matched = [False] * len(token_ids)
    depth = [0] * len(token_ids)
    best = ROOT
    for i, parent in enumerate(parents):
        matched[i] = (parent == ROOT or matched[parent]) and int(token_ids[i]) == argmax[parent + 1]
        depth[i] = 0 if parent == ROOT else depth[parent] + 1
        if matched[i] and (best == ROOT or depth[i] > depth[best]):
            best = i
    return path_to(parents, best), int(argmax[best + 1])


def tree_rejection_sample(target_probs: torch.Tensor, token_ids: Sequence[int], parents: Sequence[int],
                          draft_dists: Sequence[SparseDist], generator: torch.Generator) -> tuple[list[int], int]:
    """target_probs [n+1, V] (from `logits_to_probs`); draft_dists[i] = q of node i given its path.

    Returns (accepted node indices in path order, the final token: a residual sample or the bonus)."""
    vocab_size = _check(target_probs, token_ids, parents, "target_probs")
    if len(draft_dists) != len(token_ids):
        raise ValueError(f"got {len(token_ids)} tree nodes but {len(draft_dists)} draft distributions")
    p_all = target_probs.detach().to(device="cpu", dtype=torch.float64)     # [n+1, V]
    if not float(p_all.min()) >= 0.0:
        raise ValueError("target_probs must be non-negative and finite")
    n = len(token_ids)
    u = torch.rand(n + 1, generator=generator, dtype=torch.float64).tolist()
    accepted: list[int] = []
    node = ROOT
    while True:
        weights = p_all[node + 1]                # the current p_i, unnormalized (mass `total`)
        total = 1.0
        for child in children(parents, node):
            token = int(token_ids[child])
            q_x = draft_dists[child].prob(token)
            if q_x > 0.0 and u[child] < float(weights[token]) / (total * q_x):
                break
            residual = (weights / total - draft_dists[child].dense(vocab_size)).clamp_(min=0.0)
            residual_mass = float(residual.sum())
            if residual_mass > _RESIDUAL_EPS:
                weights, total = residual, residual_mass
        else:
            return accepted, inverse_cdf_index(weights, u[n])
        accepted.append(child)
        node = child
