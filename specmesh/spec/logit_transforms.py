"""Logit transforms that come before `logits_to_probs`: repetition_penalty, then logit_bias.

Both the verifier (on p) and the draft service (on q) apply them, to every row they sample or check, so rejection
sampling stays exact and greedy equals target-only greedy with the same transforms. The repetition penalty of a row
depends on the tokens before its position: the context (prompt + output so far) plus, within one verify block, the
drafts before that row (a chain: drafts[:i] for row i; a tree: the tokens on the row's path). `seen` masks say which
tokens each row penalises.

Order, for each row: repetition_penalty (a seen token's logit l becomes l / r when l > 0, else l * r, as in
transformers' RepetitionPenaltyLogitsProcessor and vLLM), then logit_bias (added), then `logits_to_probs`
(temperature, top-k, top-p, min-p).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.spec.sampling import SamplingParams
from specmesh.spec.tree import ROOT


def _context_mask(context: Sequence[int], num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, V] bool: every row sees the context's tokens (ids >= V, another model's vocabulary, are dropped)."""
    mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool)
    ids = torch.tensor(sorted({int(t) for t in context if 0 <= int(t) < vocab_size}), dtype=torch.long)
    if ids.numel():
        mask[:, ids] = True
    return mask


def chain_seen(context: Sequence[int], extra_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """Rows [len(extra_ids) + 1, V]: row i follows context + extra_ids[:i] (a chain verify or draft guesses)."""
    mask = _context_mask(context, len(extra_ids) + 1, vocab_size)
    for i, token in enumerate(extra_ids):
        if 0 <= int(token) < vocab_size:
            mask[i + 1:, int(token)] = True
    return mask


def tree_seen(context: Sequence[int], token_ids: Sequence[int], parents: Sequence[int],
              vocab_size: int) -> torch.Tensor:
    """Rows [n + 1, V] of a token tree: row 0 follows the context, row i + 1 the context + node i's path."""
    mask = _context_mask(context, len(token_ids) + 1, vocab_size)
    for i, (token, parent) in enumerate(zip(token_ids, parents, strict=True)):
        if parent != ROOT:                        # parents come first: inherit the parent's path
            mask[i + 1] |= mask[parent + 1]
        if 0 <= int(token) < vocab_size:
            mask[i + 1, int(token)] = True
    return mask


def adjust_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None) -> torch.Tensor:
    """logits [N, V] -> the transformed logits [N, V] float32 (the input itself when no transform applies).

    seen [N, V] bool: required when params.repetition_penalty != 1. logit_bias ids >= V are ignored (a draft
    with a smaller vocabulary simply never proposes them)."""
    if not params.needs_context and not params.logit_bias:
        return logits
    out = logits.detach().to(device="cpu", dtype=torch.float32).clone()
    if params.needs_context:
        if seen is None or tuple(seen.shape) != tuple(out.shape):
            raise ValueError(f"repetition_penalty needs a seen mask of shape {tuple(out.shape)}")
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    vocab_size = out.shape[-1]
    pairs = [(t, b) for t, b in params.logit_bias if t < vocab_size]
    if pairs:
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        out[:, ids] += torch.tensor([b for _, b in pairs], dtype=torch.float32)
    return out


def adjust_chain(logits: torch.Tensor, params: SamplingParams, context: Sequence[int],
                 extra_ids: Sequence[int]) -> torch.Tensor:
    """`adjust_logits` for rows that follow context + extra_ids[:i]."""
    seen = chain_seen(context, extra_ids, logits.shape[-1]) if params.needs_context else None
    return adjust_logits(logits, params, seen)


def adjust_tree(logits: torch.Tensor, params: SamplingParams, context: Sequence[int], token_ids: Sequence[int],
                parents: Sequence[int]) -> torch.Tensor:
    """`adjust_logits` for the rows of a token tree."""
    seen = tree_seen(context, token_ids, parents, logits.shape[-1]) if params.needs_context else None
    return adjust_logits(logits, params, seen)
