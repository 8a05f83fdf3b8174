"""The batched greedy verify agrees with the chain oracle `specmesh.spec.rejection.verify_greedy` on every request."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.batched_rejection import greedy_accept, greedy_verify_batch
from specmesh.spec.rejection import verify_greedy


def test_batched_greedy_verify_equals_the_oracle_per_request() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 7                                   # small vocabulary: many accepts and many ties
    for _ in range(200):
        num_requests = int(torch.randint(1, 6, (1,), generator=g))
        drafts = [torch.randint(0, vocab, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(num_requests)]
        rows = [torch.randint(0, 3, (len(d) + 1, vocab), generator=g).float() for d in drafts]   # ties
        for d, r in zip(drafts, rows, strict=True):      # make some drafts the argmax, so runs get accepted
            for i, t in enumerate(d):
                if torch.rand((), generator=g) < 0.7:
                    r[i, t] = 5.0
        got = greedy_verify_batch(torch.cat(rows), drafts)
        assert got == [verify_greedy(r, d) for d, r in zip(drafts, rows, strict=True)]


def test_all_accepted_emits_the_bonus_token() -> None:
    assert greedy_accept([4, 5, 9], [4, 5]) == [4, 5, 9]
    assert greedy_accept([4, 6, 9], [4, 5]) == [4, 6]
    assert greedy_accept([3], []) == [3]


def test_shape_and_vocabulary_errors() -> None:
    with pytest.raises(ValueError):
        greedy_verify_batch(torch.zeros(3, 4), [[1], [2]])      # needs 4 rows
    with pytest.raises(ValueError):
        greedy_verify_batch(torch.zeros(2, 4), [[9]])           # id outside the vocabulary
