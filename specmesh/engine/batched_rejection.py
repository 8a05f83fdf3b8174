"""Greedy verification of a forward's finished requests: `BatchedEngine.argmax_rows` takes one argmax over all the
forward's logits rows [num_tokens, vocab] (as vLLM v1's rejection sampler does over `cu_num_draft_tokens`), then
each request's acceptance is plain ints (`greedy_accept`).

`specmesh.spec.rejection.verify_greedy` is the oracle (tests/test_batched_rejection.py checks they agree, ties
included).
Sampled and tree verification run per request (verifier_service/verdicts.py).
"""

from __future__ import annotations

from collections.abc import Sequence


def greedy_accept(target_ids: Sequence[int], draft_ids: Sequence[int]) -> list[int]:
    """target_ids: the target's argmax after each prefix (len(draft_ids) + 1 of them). Returns the accepted drafts
    and one target token."""
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(f"{len(target_ids)} target rows for {len(draft_ids)} drafts")
    for i, draft in enumerate(draft_ids):
        if int(draft) != target_ids[i]:
            return [*map(int, draft_ids[:i]), target_ids[i]]
    return [*map(int, draft_ids), target_ids[-1]]
