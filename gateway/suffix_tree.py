"""Suffix-tree speculation (SuffixDecoding, Oliaro et al. 2024) on plain ints: count tries and how to draft from them.

A `CountNode` is a node of a suffix trie below a matched context suffix: `count` = how often the path from the
match to this node was seen, children keyed by their token. Two layers build such tries: the request's own context
(`gateway/suffix_index.py`: every earlier occurrence of the context's longest repeated suffix) and the shared store
of verified outputs (`trie_from_continuations`: the stored continuations after a suffix and their counts).

`speculate` grows a draft from a trie best-first by the estimated probability that a node is accepted, the product
of count(child) / count(parent) along its path, and stops when that falls below `min_prob` or the token budget is
spent. Chains follow the most frequent child; with `max_branches` > 1 a node's next most frequent children become
branches of a tree (`parents`, the token-tree convention of `gateway.proposers.base.Draft`). The score, the sum of the
nodes' probabilities, is the expected number of accepted draft tokens under the trie's own statistics.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MIN_PROB = 0.1               # stop growing a draft where the estimated acceptance falls below this
SPEC_FACTOR = 2.0            # draft at most SPEC_FACTOR * match length tokens (a short match is weak evidence)


@dataclass
class CountNode:
    count: int = 0
    children: dict[int, CountNode] = field(default_factory=dict)


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    parents: list[int]               # parents[i] < i; -1 = a child of the pending token
    probs: list[float]               # estimated probability that node i is accepted (its path's count ratio)
    match_len: int = 0               # context tokens the trie's root matched

    @property
    def score(self) -> float:
        """Expected accepted draft tokens."""
        return sum(self.probs)

    def prefix(self, num_nodes: int) -> Proposal:
        """The first `num_nodes` nodes: still a tree (best-first growth puts every parent before its children)."""
        return Proposal(self.token_ids[:num_nodes], self.parents[:num_nodes], self.probs[:num_nodes], self.match_len)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


EMPTY = Proposal([], [], [])


def trie_from_continuations(continuations: Iterable[tuple[Sequence[int], int]]) -> CountNode:
    """The trie of stored continuations: a node counts every continuation that passes through it."""
    root = CountNode()
    for tokens, count in continuations:
        if count <= 0 or not tokens:
            continue
        root.count += count
        node = root
        for t in tokens:
            node = node.children.setdefault(t, CountNode())
            node.count += count
    return root


def merge_tries(tries: Iterable[CountNode]) -> CountNode:
    """One trie whose counts add up (e.g. the same suffix found in two stores)."""
    root = CountNode()
    for trie in tries:
        _add_into(root, trie)
    return root


def _add_into(target: CountNode, source: CountNode) -> None:
    target.count += source.count
    for t, child in source.children.items():
        _add_into(target.children.setdefault(t, CountNode()), child)


def _ranked(node: CountNode) -> list[tuple[int, CountNode]]:
    """Children, most frequent first (ties: smaller token id, so drafts are deterministic)."""
    return sorted(node.children.items(), key=lambda item: (-item[1].count, item[0]))


def speculate(root: CountNode, max_tokens: int, match_len: int = 0, min_prob: float = MIN_PROB,
              max_branches: int = 1, spec_factor: float = SPEC_FACTOR) -> Proposal:
    """Best-first growth from the root (see the module doc). max_branches = 1: a chain."""
    if match_len > 0:
        max_tokens = min(max_tokens, max(1, int(spec_factor * match_len)))
    if max_tokens <= 0 or root.count <= 0:
        return EMPTY
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    order = 0                                          # heap tie-break: first pushed, first popped
    heap: list[tuple[float, int, int, int, CountNode]] = []

    def push(node: CountNode, index: int, prob: float) -> None:
        nonlocal order
        for t, child in _ranked(node)[:max_branches]:
            p = prob * child.count / node.count
            if p >= min_prob:
                heapq.heappush(heap, (-p, order, t, index, child))
                order += 1

    push(root, -1, 1.0)
    while heap and len(tokens) < max_tokens:
        neg_p, _, t, parent, node = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent)
        probs.append(-neg_p)
        if node.count > 0:
            push(node, len(tokens) - 1, -neg_p)
    return Proposal(tokens, parents, probs, match_len)


def accepted_nodes(proposal: Proposal, accepted_ids: Sequence[int]) -> list[int]:
    """Indices of the proposal's nodes along the path the verifier accepted (its accepted token ids, in order)."""
    path: list[int] = []
    parent = -1
    for t in accepted_ids:
        nxt = next((i for i, (tok, p) in enumerate(zip(proposal.token_ids, proposal.parents, strict=True))
                    if p == parent and tok == t), None)
        if nxt is None:
            break
        path.append(nxt)
        parent = nxt
    return path
