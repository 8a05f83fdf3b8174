"""Greedy verification of every finished request of a forward in one step (as vLLM v1's rejection sampler does with
`cu_num_draft_tokens`): one argmax over all logits rows [num_tokens, vocab], then plain-int acceptance per request.

`specmesh.spec.rejection.verify_greedy` is the oracle (tests/test_batched_rejection.py checks they agree, ties
included).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch


def greedy_accept(target_ids: Sequence[int], draft_ids: Sequence[int]) -> list[int]:
    """target_ids: the target's argmax after each prefix (len(draft_ids) + 1 of them). Returns the accepted drafts
    and one target token."""
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(f"{len(target_ids)} target rows for {len(draft_ids)} drafts")
    for i, draft in enumerate(draft_ids):
        if int(draft) != target_ids[i]:
            return [*map(int, draft_ids[:i]), target_ids[i]]
    return [*map(int, draft_ids), target_ids[-1]]


def cu_num_rows(draft_ids: Sequence[Sequence[int]]) -> list[int]:
    """Row offsets of each request in the flattened logits: request i has rows [cu[i], cu[i + 1])."""
    return [0, *accumulate(len(d) + 1 for d in draft_ids)]


def greedy_verify_batch(logits: torch.Tensor, draft_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """logits [sum(len(d) + 1), vocab]: each request's k + 1 rows back to back. Returns each request's emitted
    tokens (accepted drafts + one target token). Ties go to the lowest token id, as in `verify_greedy`."""
    cu = cu_num_rows(draft_ids)
    if logits.dim() != 2 or logits.shape[0] != cu[-1]:
        raise ValueError(f"logits {tuple(logits.shape)} do not hold {cu[-1]} rows")
    vocab = logits.shape[1]
    if any(not 0 <= int(t) < vocab for drafts in draft_ids for t in drafts):
        raise ValueError(f"draft token id outside vocabulary [0, {vocab})")
    target = torch.argmax(logits, dim=-1).tolist() if cu[-1] else []
    return [greedy_accept(target[cu[i]:cu[i + 1]], drafts) for i, drafts in enumerate(draft_ids)]
