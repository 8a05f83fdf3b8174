"""Token trees of draft candidates, on plain ints.

A tree is a flattened list of nodes: `parents[i]` is the index of node i's parent among the nodes, or -1 (ROOT) for
a child of the root. The root is the pending token: the last verified token, whose KV is not computed yet. Nodes are
in topological order (`parents[i] < i`), so a forward can run `[root, node 0, ..., node n-1]` as one block.

Indices of the block: row 0 is the root, row i + 1 is node i. Depth counts a node's ancestors among the nodes (a
child of the root has depth 0), so node i sits at position `root_pos + 1 + depth(i)`: exactly where it would be if
its path were decoded alone. A chain of k drafts is `parents = [-1, 0, 1, ..., k-2]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ROOT = -1


def chain_parents(num_nodes: int) -> list[int]:
    """The parents of a chain (today's drafts): node i follows node i - 1."""
    return list(range(-1, num_nodes - 1))


def check_parents(parents: Sequence[int], num_nodes: int) -> None:
    """ValueError unless `parents` describes `num_nodes` nodes in topological order."""
    if len(parents) != num_nodes:
        raise ValueError(f"parents has {len(parents)} entries for {num_nodes} nodes")
    for i, parent in enumerate(parents):
        if not ROOT <= parent < i:
            raise ValueError(f"parents[{i}] = {parent} must be in [-1, {i})")


def is_chain(parents: Sequence[int]) -> bool:
    return list(parents) == chain_parents(len(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """depth of every node: 0 for a child of the root."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent == ROOT else out[parent] + 1)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root's child down to `node` (inclusive); [] for the root."""
    path: list[int] = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def children(parents: Sequence[int], node: int) -> list[int]:
    """Children of `node` (ROOT for the root), in index order: the order in which they are tried."""
    return [i for i, parent in enumerate(parents) if parent == node]


def visible_rows(parents: Sequence[int]) -> list[list[int]]:
    """For each row of the block [root, nodes...], the rows it attends to: the root, its ancestors, itself."""
    rows = [[0]]
    for i, parent in enumerate(parents):
        rows.append(rows[parent + 1] + [i + 1])
    return rows


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """Bool [n+1, n+1]: mask[r, c] is True when row r of the block may attend to row c."""
    mask = torch.zeros(len(parents) + 1, len(parents) + 1, dtype=torch.bool)
    for r, visible in enumerate(visible_rows(parents)):
        mask[r, visible] = True
    return mask


def keep_shallow(parents: Sequence[int], num_levels: int) -> tuple[list[int], list[int]]:
    """The nodes at depth < num_levels: (their indices, their parents renumbered among them). A node's ancestors
    are shallower, so the kept nodes form a tree again (for a chain: its first num_levels nodes)."""
    kept = [i for i, d in enumerate(depths(parents)) if d < num_levels]
    new_index = {old: new for new, old in enumerate(kept)}
    return kept, [ROOT if parents[i] == ROOT else new_index[parents[i]] for i in kept]


def block_layout(num_prefix: int, parents: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """A forward block of `num_prefix` context tokens, then the root, then the tree's nodes.

    Returns (position offset of each row from the block's first position, the rows each row attends to among the
    block in key order): context rows are causal, the root sees them all, and each node sees them, the root and its
    ancestors. Node i's offset is num_prefix + 1 + depth(i): where its path would put it if decoded alone."""
    offsets = list(range(num_prefix + 1)) + [num_prefix + 1 + d for d in depths(parents)]
    causal = [list(range(r + 1)) for r in range(num_prefix)]
    tree_rows = [[num_prefix + c for c in rows] for rows in visible_rows(parents)]
    return offsets, causal + [list(range(num_prefix)) + rows for rows in tree_rows]
