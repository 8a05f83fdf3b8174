"""The verifier's greedy verify (one argmax over every row of the forward, as `BatchedEngine.argmax_rows` takes it,
then `greedy_accept` on each request's rows) agrees with the chain oracle `specmesh.spec.rejection.verify_greedy`."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from specmesh.engine.batched_rejection import greedy_accept
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
        argmax = torch.argmax(torch.cat(rows), dim=-1).tolist()        # the forward's one argmax
        cu = [0, *accumulate(len(d) + 1 for d in drafts)]               # request i: rows cu[i] .. cu[i + 1] - 1
        got = [greedy_accept(argmax[cu[i]:cu[i + 1]], d) for i, d in enumerate(drafts)]
        assert got == [verify_greedy(r, d) for d, r in zip(drafts, rows, strict=True)]


def test_all_accepted_emits_the_bonus_token() -> None:
    assert greedy_accept([4, 5, 9], [4, 5]) == [4, 5, 9]
    assert greedy_accept([4, 6, 9], [4, 5]) == [4, 6]
    assert greedy_accept([3], []) == [3]


def test_rows_must_match_the_drafts() -> None:
    with pytest.raises(ValueError):
        greedy_accept([1, 2], [1, 2])           # needs 3 rows
