"""Statistical exactness of tree rejection sampling (specmesh/spec/tree_rejection.py), with the chi-square harness of
tests/test_rejection_sampler.py: for every tree, the first emitted token is distributed as p after the root, and the
second, given the first, as p after that token. A broken tree sampler (no residual update) must fail the same test.

The target's p and the draft's q after a path are fixed functions of the path's tokens, as with real models, so
duplicate candidates see the same p; each sampled node is drawn independently from its q given its path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from zlib import crc32

import pytest
import torch

from specmesh.spec.rejection import SparseDist
from specmesh.spec.sampling import (
    SamplingParams,
    inverse_cdf_index,
    logits_to_probs,
    make_generator,
    sample_sparse,
    sparsify,
)
from specmesh.spec.tree import ROOT, children, path_to
from specmesh.spec.tree_rejection import tree_rejection_sample
from tests.chi_square import MIN_PVALUE, fit

V = 8
N_TRIALS = 6_000
PARAMS = SamplingParams(temperature=1.0)

TreeSampler = Callable[[torch.Tensor, Sequence[int], Sequence[int], Sequence[SparseDist], torch.Generator],
                       tuple[list[int], int]]


def stable_seed(*key: object) -> int:
    """A seed fixed across processes (hash() of a str is salted per process by PYTHONHASHSEED)."""
    return crc32(repr(key).encode())


@cache
def target_p(path: tuple[int, ...]) -> torch.Tensor:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(stable_seed("p", path))) * 1.2
    return logits_to_probs(logits[None], PARAMS)[0].to(torch.float64)


@cache
def draft_q(path: tuple[int, ...], variant: int) -> SparseDist:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(stable_seed("q", path, variant))) * 1.2
    return SparseDist(*sparsify(logits_to_probs(logits[None], PARAMS)[0], V))


@dataclass(frozen=True)
class Node:
    parent: int
    one_hot: int | None = None     # a deterministic candidate; else drawn from q (variant: which q)
    variant: int = 0


TREES = {
    "two_independent_q_children": [Node(-1, variant=0), Node(-1, variant=1), Node(0), Node(1)],
    "one_hot_and_sampled_child": [Node(-1, one_hot=3), Node(-1, variant=1), Node(0), Node(1, one_hot=5)],
    "duplicate_candidates": [Node(-1, variant=0), Node(-1, variant=0), Node(-1, one_hot=2), Node(-1, one_hot=2),
                             Node(0), Node(1)],
    "deeper_tree": [Node(-1, variant=0), Node(0), Node(1), Node(0, variant=1), Node(-1, one_hot=6), Node(4),
                    Node(5), Node(-1, variant=2)],
}


def draw_tree(nodes: list[Node], gen: torch.Generator) -> tuple[list[int], list[int], list[SparseDist]]:
    """Token ids, parents and q of one drafted tree (nodes drawn in topological order)."""
    token_ids: list[int] = []
    dists: list[SparseDist] = []
    parents = [n.parent for n in nodes]
    for node in nodes:
        if node.one_hot is not None:
            dists.append(SparseDist([node.one_hot], [1.0]))
            token_ids.append(node.one_hot)
            continue
        path = tuple(token_ids[j] for j in path_to(parents, node.parent))
        dists.append(draft_q(path, node.variant))
        token_ids.append(sample_sparse(list(dists[-1].token_ids), list(dists[-1].probs), gen))
    return token_ids, parents, dists


def run_trials(sampler: TreeSampler, nodes: list[Node], n: int, seed: int) -> list[list[int]]:
    gen = make_generator(seed)
    out = []
    for _ in range(n):
        token_ids, parents, dists = draw_tree(nodes, gen)
        paths = [()] + [tuple(token_ids[j] for j in path_to(parents, i)) for i in range(len(nodes))]
        target = torch.stack([target_p(p) for p in paths])
        accepted, final = sampler(target, token_ids, parents, dists, gen)
        out.append([token_ids[i] for i in accepted] + [final])
    return out


def assert_lossless(emitted: list[list[int]], min_n: int = 400) -> int:
    """Chi-square of the first token against p(root) and of the second given the first; returns #laws tested."""
    first = torch.zeros(V, dtype=torch.float64)
    second: dict[int, torch.Tensor] = {}
    for e in emitted:
        first[e[0]] += 1
        if len(e) > 1:
            second.setdefault(e[0], torch.zeros(V, dtype=torch.float64))[e[1]] += 1
    pvalue, tv = fit(first, target_p(()))
    assert pvalue > MIN_PVALUE, f"first token: p-value {pvalue:.2e}, TV {tv:.4f}"
    tested = 1
    for token, counts in second.items():
        if counts.sum() >= min_n:
            pvalue, tv = fit(counts, target_p((token,)))
            assert pvalue > MIN_PVALUE, f"second token after {token}: p-value {pvalue:.2e}, TV {tv:.4f}"
            tested += 1
    return tested


@pytest.mark.parametrize("name", list(TREES))
def test_tree_rejection_sampling_is_lossless(name: str) -> None:
    emitted = run_trials(tree_rejection_sample, TREES[name], N_TRIALS, seed=4321)
    assert assert_lossless(emitted) >= 2          # the conditional second-token law is actually tested
    assert sum(len(e) > 1 for e in emitted) > N_TRIALS // 3


def no_residual_update(target: torch.Tensor, token_ids: Sequence[int], parents: Sequence[int],
                       dists: Sequence[SparseDist], gen: torch.Generator) -> tuple[list[int], int]:
    """Bug: every child is tested against the unchanged p, and the final token is drawn from p."""
    accepted: list[int] = []
    node = ROOT
    while True:
        p = target[node + 1]
        for child in children(parents, node):
            token = token_ids[child]
            u = float(torch.rand((), generator=gen, dtype=torch.float64))
            if u < float(p[token]) / dists[child].prob(token):
                break
        else:
            return accepted, inverse_cdf_index(p, float(torch.rand((), generator=gen, dtype=torch.float64)))
        accepted.append(child)
        node = child


def test_statistics_detect_a_tree_sampler_without_residual_update() -> None:
    emitted = run_trials(no_residual_update, TREES["two_independent_q_children"], 3000, seed=4321)
    with pytest.raises(AssertionError):
        assert_lossless(emitted)
