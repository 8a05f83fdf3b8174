"""Seeded sampling that speculation cannot change: the token at each position is fixed by (seed, position, context).

A seeded sampled request draws the token at absolute position j (prompt + output index) by the Gumbel-max trick in
its exponential-race form: token = argmax_v p(v) / E_v, with E_v = -log(U_v) ~ Exp(1) and U_v a uniform hashed from
(seed, j, v) alone (splitmix64). argmax_v p(v) / E_v is distributed exactly as p (the race of independent
exponentials with rates p(v)); a fresh position has noise independent of every earlier one, so a sequence drawn this
way follows the target's distribution exactly, token after token.

Speculation only guesses those tokens: the verifier accepts a draft iff it equals the target's token at its
position, and always emits the target's own token where the block ends. The output is therefore a function of the
seed, the request and the target's logits alone: the same with k = 0 and with any k, any drafts (model, cache,
n-gram, suffix, trees), any draft-ahead, load or timing. The draft service draws its tokens from q with the SAME
noise, so a draft close to the target mostly proposes the very token the target draws (P(match) >= (1 - TV) /
(1 + TV) for the Gumbel coupling, against 1 - TV for rejection sampling; Daliri et al., "Coupling without
Communication and Drafter-Invariant Speculative Decoding", 2024). One-hot drafts (cache, n-gram, suffix) match with
probability p(d), as under rejection sampling.

Exactness does not depend on how drafts were made: each emitted token is the target's own draw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from specmesh.spec.tree import ROOT, children

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix_int(z: int) -> int:
    """splitmix64 finalizer on a Python int (64-bit wrap-around)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix_array(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (numpy wraps uint64 arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def exponentials(seed: int, position: int, token_ids: np.ndarray) -> np.ndarray:
    """E_v = -log(U_v) ~ Exp(1) for each token id [n] (int64), U_v in (0, 1) hashed from (seed, position, v)."""
    key = _mix_int(_mix_int(seed + _GOLDEN) + (position + 1) * _GOLDEN)
    z = _mix_array(np.uint64(key) + (token_ids.astype(np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN))
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53          # 53 random bits, never 0 or 1
    return -np.log(u)


def seeded_token(probs: torch.Tensor, seed: int, position: int) -> int:
    """The token at `position` drawn from probs [V] (any non-negative weights with positive mass)."""
    p = probs.detach().to(device="cpu", dtype=torch.float64).numpy()
    support = np.flatnonzero(p > 0)
    if support.size == 0:
        raise ValueError("probs has no positive mass")
    race = p[support] / exponentials(seed, position, support)
    return int(support[int(np.argmax(race))])


def seeded_sparse(token_ids: Sequence[int], token_probs: Sequence[float], seed: int, position: int) -> int:
    """`seeded_token` for a sparse distribution (ids with their probabilities): the same draw restricted to them."""
    ids = np.asarray(token_ids, dtype=np.int64)
    p = np.asarray(token_probs, dtype=np.float64)
    keep = p > 0
    if not keep.any():
        raise ValueError("token_probs has no positive mass")
    race = np.where(keep, p, 0.0) / exponentials(seed, position, ids)
    return int(ids[int(np.argmax(race))])


def accept_chain(target_token: Callable[[int], int], draft_ids: Sequence[int]) -> list[int]:
    """target_token(i): the target's token for row i (the position after context + drafts[:i]). Accept drafts while
    they equal it; then the target's token of the first other row. Rows past the first mismatch are never drawn."""
    emitted: list[int] = []
    for i, draft in enumerate(draft_ids):
        token = target_token(i)
        emitted.append(token)
        if int(draft) != token:
            return emitted
    emitted.append(target_token(len(draft_ids)))
    return emitted


def accept_tree(target_token: Callable[[int, int], int], token_ids: Sequence[int],
                parents: Sequence[int]) -> tuple[list[int], int]:
    """target_token(row, depth): the target's token for a tree row (0 = after the root, i + 1 = after node i) at
    depth rows below the root. Walk down: the first child holding the target's token is accepted (any matching
    child is the same token; the first keeps the choice deterministic); where none does, the target's token ends
    the walk. Returns (accepted node indices in path order, the final token)."""
    accepted: list[int] = []
    node, depth = ROOT, 0
    while True:
        token = target_token(node + 1, depth)
        match = next((c for c in children(parents, node) if int(token_ids[c]) == token), None)
        if match is None:
            return accepted, token
        accepted.append(match)
        node, depth = match, depth + 1
