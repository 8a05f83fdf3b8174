"""Token trees from the draft service's chain and its alternatives (GatewayConfig.draft_tree_width > 0).

The tree is the chain d_0..d_{k-1} (parents -1, 0, ..., k-2) followed by alternative leaves: an alternative a at
position i is a sibling of d_i (parent i - 1, or -1 at position 0). Nodes are in topological order and a node's
children are tried in index order, so the drafted token always comes before its alternatives.

Exactness: the chain tokens are sampled from their q (sent as draft_dists); alternatives are deterministic one-hot
candidates (q = delta(a)), tried after the sampled child, which is exact under recursive rejection sampling (see the
conventions in specmesh/spec/tree_rejection.py). Greedy drafts carry no dists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specmesh.spec.rejection import SparseDist

MAX_TREE_NODES = 32    # chain + alternatives in one Verify (the verifier's limits are 64 drafts and the step budget)


def chain_parents(k: int) -> list[int]:
    return list(range(-1, k - 1))


def main_chain_len(parents: Sequence[int] | None, num_nodes: int) -> int:
    """How many leading nodes form a chain from the root (all of them for a chain)."""
    if parents is None:
        return num_nodes
    n = 0
    while n < len(parents) and parents[n] == n - 1:
        n += 1
    return n


def build_tree(chain_ids: Sequence[int], chain_dists: Sequence[SparseDist] | None,
               alternatives: Mapping[int, Sequence[int]],
               max_nodes: int = MAX_TREE_NODES) -> tuple[list[int], list[int] | None, list[SparseDist] | None]:
    """(token ids, parents or None for a plain chain, dists or None). Earlier positions' alternatives first: they
    are the likeliest to be reached; the tree stops growing at max_nodes."""
    ids, parents = list(chain_ids), chain_parents(len(chain_ids))
    dists = list(chain_dists) if chain_dists else None
    for position in sorted(alternatives):
        if not 0 <= position < len(chain_ids):
            continue
        for token in alternatives[position]:
            if len(ids) >= max_nodes:
                break
            ids.append(int(token))
            parents.append(position - 1)
            if dists is not None:
                dists.append(SparseDist((int(token),), (1.0,)))
    if len(ids) == len(chain_ids):
        return ids, None, dists
    return ids, parents, dists
