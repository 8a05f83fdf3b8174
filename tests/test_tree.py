"""Token trees: bookkeeping (specmesh/spec/tree.py) and greedy / sampled tree verification against the chain oracle
(specmesh/spec/rejection.py). Statistical exactness of tree sampling: tests/test_tree_rejection.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specmesh.spec.rejection import SparseDist, rejection_sample, verify_greedy
from specmesh.spec.sampling import make_generator, sparsify
from specmesh.spec.tree import (
    ancestor_mask,
    block_layout,
    chain_parents,
    check_parents,
    children,
    depths,
    is_chain,
    keep_shallow,
    path_to,
    visible_rows,
)
from specmesh.spec.tree_rejection import tree_rejection_sample, verify_tree_greedy

#          root
#        /   |   \
#       0    1    4
#      / \   |
#     2   3  5
PARENTS = [-1, -1, 0, 0, -1, 1]


def test_bookkeeping() -> None:
    assert depths(PARENTS) == [0, 0, 1, 1, 0, 1]
    assert path_to(PARENTS, 3) == [0, 3] and path_to(PARENTS, 5) == [1, 5] and path_to(PARENTS, -1) == []
    assert children(PARENTS, -1) == [0, 1, 4] and children(PARENTS, 0) == [2, 3] and children(PARENTS, 2) == []
    assert visible_rows(PARENTS)[4] == [0, 1, 4] and visible_rows(PARENTS)[6] == [0, 2, 6]
    mask = ancestor_mask(PARENTS)
    assert mask.shape == (7, 7) and mask[:, 0].all() and mask.diagonal().all()
    assert mask[4].tolist() == [True, True, False, False, True, False, False]
    assert chain_parents(3) == [-1, 0, 1] and is_chain([-1, 0, 1]) and not is_chain(PARENTS)
    assert torch.equal(ancestor_mask(chain_parents(4)), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-2], [-1, 0, 5]])
def test_parents_must_point_backwards(parents: list[int]) -> None:
    with pytest.raises(ValueError):
        check_parents(parents, len(parents))
    with pytest.raises(ValueError):
        check_parents([-1], 2)


def _row(path: tuple[int, ...], vocab: int) -> torch.Tensor:
    """The target's logits after a path: a fixed function of the path tokens (as a real target's would be)."""
    seed = hash(path) % (2**31)
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def _tree_logits(token_ids: list[int], parents: list[int], vocab: int) -> torch.Tensor:
    paths = [()] + [tuple(token_ids[j] for j in path_to(parents, i)) for i in range(len(parents))]
    return torch.stack([_row(p, vocab) for p in paths])


@st.composite
def trees(draw: st.DrawFn, vocab: int) -> tuple[list[int], list[int]]:
    n = draw(st.integers(0, 10))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    token_ids = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    return token_ids, parents


@settings(max_examples=200, deadline=None)
@given(tree=trees(vocab=3))
def test_greedy_tree_equals_the_chain_oracle_on_its_path(tree: tuple[list[int], list[int]]) -> None:
    token_ids, parents = tree
    logits = _tree_logits(token_ids, parents, 3)
    accepted, next_token = verify_tree_greedy(logits, token_ids, parents)
    rows = [0] + [i + 1 for i in accepted]
    path_tokens = [token_ids[i] for i in accepted]
    assert not accepted or accepted == path_to(parents, accepted[-1])
    assert verify_greedy(logits[rows], path_tokens) == [*path_tokens, next_token]
    # Longest: no node goes deeper while matching the argmax all along its path.
    argmax = logits.argmax(-1).tolist()
    for i in range(len(parents)):
        path = path_to(parents, i)
        if all(token_ids[j] == argmax[parents[j] + 1] for j in path):
            assert len(path) <= len(accepted)


def test_greedy_picks_the_deeper_duplicate() -> None:
    # Two candidates for the same token: only the second one's subtree continues the argmax.
    token = int(_row((), 3).argmax())
    after = int(_row((token,), 3).argmax())
    token_ids, parents = [token, token, after], [-1, -1, 1]
    assert verify_tree_greedy(_tree_logits(token_ids, parents, 3), token_ids, parents)[0] == [1, 2]


def test_greedy_without_a_match_emits_the_root_argmax() -> None:
    logits = torch.zeros(3, 4)
    logits[0, 2] = 1.0
    assert verify_tree_greedy(logits, [0, 1], [-1, -1]) == ([], 2)
    assert verify_tree_greedy(logits[:1], [], []) == ([], 2)
    with pytest.raises(ValueError):
        verify_tree_greedy(logits, [0, 9], [-1, -1])
    with pytest.raises(ValueError):
        verify_tree_greedy(logits, [0, 1], [-1, 1])


@pytest.mark.parametrize("seed", range(5))
def test_chain_tree_samples_exactly_like_rejection_sample(seed: int) -> None:
    gen = make_generator(seed)
    vocab, k = 6, 4
    for _ in range(200):
        p = torch.softmax(torch.randn(k + 1, vocab, generator=gen, dtype=torch.float64) * 2, -1)
        q_rows = torch.softmax(torch.randn(k, vocab, generator=gen, dtype=torch.float64) * 2, -1)
        dists = [SparseDist(*sparsify(q_rows[i], 3)) for i in range(k)]
        drafts = [int(d.token_ids[int(torch.randint(len(d.token_ids), (1,), generator=gen))]) for d in dists]
        state = gen.get_state()
        expected = rejection_sample(p, drafts, dists, gen)
        gen.set_state(state)
        accepted, final = tree_rejection_sample(p, drafts, chain_parents(k), dists, gen)
        assert accepted == list(range(len(expected) - 1))
        assert [drafts[i] for i in accepted] + [final] == expected


def test_tree_sampling_validation() -> None:
    p = torch.full((3, 4), 0.25)
    one_hot = SparseDist([0], [1.0])
    gen = make_generator(0)
    with pytest.raises(ValueError):
        tree_rejection_sample(p, [0, 1], [-1, -1], [one_hot], gen)
    with pytest.raises(ValueError):
        tree_rejection_sample(p, [0, 1], [0, -1], [one_hot, one_hot], gen)
    with pytest.raises(ValueError):
        tree_rejection_sample(p[:2], [0, 1], [-1, -1], [one_hot, one_hot], gen)


def test_a_rejected_one_hot_candidate_is_never_emitted_by_its_duplicate() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    one_hot = SparseDist([0], [1.0])
    gen = make_generator(1)
    outcomes = [tree_rejection_sample(p, [0, 0], [-1, -1], [one_hot, one_hot], gen) for _ in range(300)]
    assert {tuple(a) for a, _ in outcomes} == {(), (0,)}          # the duplicate (node 1) is never accepted
    assert all(final == 1 for a, final in outcomes if not a)      # rejected: the residual holds only token 1


def test_keep_shallow_prunes_to_the_context() -> None:
    assert keep_shallow(PARENTS, 1) == ([0, 1, 4], [-1, -1, -1])
    assert keep_shallow(PARENTS, 2) == (list(range(6)), PARENTS)
    assert keep_shallow(chain_parents(5), 3) == ([0, 1, 2], [-1, 0, 1])


def test_block_layout_positions_and_rows() -> None:
    offsets, rows = block_layout(2, [-1, -1, 0])
    assert offsets == [0, 1, 2, 3, 3, 4]
    assert rows == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 2, 3, 5]]
