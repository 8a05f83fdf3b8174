"""A verify block's verdict from the target's logits: greedy, seeded (specmesh/spec/seeded.py) or rejection sampling.

Every path first applies the session's logit transforms (repetition_penalty, logit_bias:
specmesh/spec/logit_transforms.py) row by row, each row seeing the context plus the drafts before it, exactly as the
draft service does for q. Row i of a chain (row r of a tree, at depth d) is the target's distribution for absolute
position len(context) + i (+ d).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specmesh.engine.batched_rejection import greedy_accept
from specmesh.spec.logit_transforms import adjust_chain, adjust_tree
from specmesh.spec.rejection import SparseDist, rejection_sample
from specmesh.spec.sampling import logits_to_probs
from specmesh.spec.seeded import accept_chain, accept_tree, seeded_token
from specmesh.spec.tree_rejection import tree_rejection_sample, verify_tree_greedy
from verifier_service.session import Session


def greedy_rows(session: Session, logits: torch.Tensor, extra_ids: Sequence[int],
                step_argmax: Callable[[], list[int]]) -> list[int]:
    """The target's greedy token of each row of a chain (or of guesses): the step's one argmax over all rows
    (step_argmax), unless repetition_penalty / logit_bias change this session's logits: then its rows, transformed."""
    params = session.params
    if not params.needs_context and not params.logit_bias:
        return step_argmax()
    return torch.argmax(adjust_chain(logits, params, session.seq.token_ids, extra_ids), dim=-1).tolist()


def chain_verdict(session: Session, logits: torch.Tensor, draft_ids: Sequence[int],
                  dists: Sequence[SparseDist] | None, step_argmax: Callable[[], list[int]]) -> list[int]:
    """logits [k+1, V] -> accepted drafts + one target token."""
    params = session.params
    if params.is_greedy:                   # verify_greedy is the oracle
        return greedy_accept(greedy_rows(session, logits, draft_ids, step_argmax), draft_ids)
    target_probs = logits_to_probs(adjust_chain(logits, params, session.seq.token_ids, draft_ids), params)
    if params.seed is not None:            # seeded (params.is_seeded: greedy returned above)
        base, seed = len(session.seq.token_ids), params.seed
        return accept_chain(lambda i: seeded_token(target_probs[i], seed, base + i), draft_ids)
    draft_dists = dists if dists else [SparseDist((t,), (1.0,)) for t in draft_ids]
    return rejection_sample(target_probs, draft_ids, draft_dists, session.generator)


def tree_verdict(session: Session, logits: torch.Tensor, node_ids: Sequence[int], parents: Sequence[int],
                 dists: Sequence[SparseDist] | None) -> tuple[list[int], int]:
    """logits [n+1, V] -> (accepted node indices in path order, the final token)."""
    params = session.params
    logits = adjust_tree(logits, params, session.seq.token_ids, node_ids, parents)
    if params.is_greedy:
        return verify_tree_greedy(logits, node_ids, parents)
    target_probs = logits_to_probs(logits, params)
    if params.seed is not None:            # seeded (params.is_seeded: greedy returned above)
        base, seed = len(session.seq.token_ids), params.seed
        return accept_tree(lambda row, depth: seeded_token(target_probs[row], seed, base + depth), node_ids, parents)
    tree_dists = dists if dists else [SparseDist((t,), (1.0,)) for t in node_ids]
    return tree_rejection_sample(target_probs, node_ids, parents, tree_dists, session.generator)
