"""Tree verification in the model runner: one forward over [root, nodes...] with an ancestor mask gives every node
the logits of decoding its path alone (int8 / int4 batch-invariant numerics: bit-identical; float32: within 1e-5), and
after `move_kv` puts the accepted path's KV at contiguous positions, decoding continues as if the path had been
decoded token by token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specmesh.engine.build import QUANTIZERS
from specmesh.engine.model_runner import ForwardItem, ModelRunner
from specmesh.models import resolve_model_dir
from specmesh.spec.tree import path_to

BLOCK = 16
TABLE = list(range(64))            # the identity: slot == position
#            root
#          /  |   \     \
#         0   1    5     10
#        / \  | \         \
#       2   3 4  (14, 15)  11 - 12 - 13
#       |   |
#       6   9
#      / \
#     7   8
PARENTS = [-1, -1, 0, 0, 1, -1, 2, 6, 6, 3, -1, 10, 11, 12, 4, 4]


@pytest.fixture(scope="module", params=["float32", "int8", "int4"])
def model(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, bool]:
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("tiny-target")), dtype=torch.float32)
    if request.param in QUANTIZERS:
        QUANTIZERS[request.param][0](model)
    return model, request.param in QUANTIZERS


def _runner(model: tuple[torch.nn.Module, bool]) -> ModelRunner:
    return ModelRunner(model[0], num_blocks=len(TABLE), block_size=BLOCK, batch_invariant=model[1])


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("context_len", [5, 130, 333])
def test_tree_forward_matches_decoding_each_path_alone(model: tuple[torch.nn.Module, bool], context_len: int) -> None:
    gen = torch.Generator().manual_seed(context_len)
    context = torch.randint(3, 500, (context_len,), generator=gen).tolist()
    nodes = torch.randint(3, 500, (len(PARENTS),), generator=gen).tolist()
    runner = _runner(model)
    runner.forward([ForwardItem(context[:-1], 0, TABLE, 0)])
    tree = runner.forward([ForwardItem([context[-1], *nodes], context_len - 1, TABLE, len(nodes) + 1,
                                       tree_parents=PARENTS)])[0]
    alone = _runner(model)
    alone.forward([ForwardItem(context[:-1], 0, TABLE, 0)])
    for node in [-1, *range(len(nodes))]:        # each path overwrites the previous one's KV as it decodes
        path = [nodes[i] for i in path_to(PARENTS, node)]
        steps = [alone.forward([ForwardItem([t], context_len - 1 + j, TABLE, 1)])[0][0]
                 for j, t in enumerate([context[-1], *path])]
        _assert_same(tree[node + 1], steps[-1], model[1])


def test_accepted_branch_kv_moved_into_place_continues_exactly(model: tuple[torch.nn.Module, bool]) -> None:
    gen = torch.Generator().manual_seed(7)
    context = torch.randint(3, 500, (9,), generator=gen).tolist()
    nodes = torch.randint(3, 500, (len(PARENTS),), generator=gen).tolist()
    accepted = path_to(PARENTS, 7)                      # nodes [0, 2, 6, 7] -> positions 9, 10, 11, 12
    base = len(context)
    runner = _runner(model)
    runner.forward([ForwardItem(context[:-1], 0, TABLE, 0)])
    runner.forward([ForwardItem([context[-1], *nodes], base - 1, TABLE, 0, tree_parents=PARENTS)])
    runner.move_kv([base + a for a in accepted], [base + j for j in range(len(accepted))])
    bonus = 321
    after = runner.forward([ForwardItem([bonus], base + len(accepted), TABLE, 1)])[0][0]

    alone = _runner(model)
    path = [nodes[i] for i in accepted]
    alone.forward([ForwardItem(context[:-1], 0, TABLE, 0)])
    for j, t in enumerate([context[-1], *path]):         # token by token, as target-only decoding would
        alone.forward([ForwardItem([t], base - 1 + j, TABLE, 1)])
    expected = alone.forward([ForwardItem([bonus], base + len(accepted), TABLE, 1)])[0][0]
    _assert_same(after, expected, model[1])


def test_tree_after_uncomputed_context_in_the_same_forward(model: tuple[torch.nn.Module, bool]) -> None:
    """A recomputed sequence (preempted) runs its context and the tree in one item: same logits as in two."""
    gen = torch.Generator().manual_seed(3)
    context = torch.randint(3, 500, (20,), generator=gen).tolist()
    nodes = torch.randint(3, 500, (len(PARENTS),), generator=gen).tolist()
    split = _runner(model)
    split.forward([ForwardItem(context[:-1], 0, TABLE, 0)])
    expected = split.forward([ForwardItem([context[-1], *nodes], 19, TABLE, len(nodes) + 1, tree_parents=PARENTS)])
    joined = _runner(model)
    joined.forward([ForwardItem(context[:6], 0, TABLE, 0)])
    actual = joined.forward([ForwardItem([*context[6:], *nodes], 6, TABLE, len(nodes) + 1, tree_parents=PARENTS)])
    _assert_same(actual[0], expected[0], model[1])
