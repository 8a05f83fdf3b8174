"""A draft LM head over part of the vocabulary (as FR-Spec does): fewer rows to multiply per drafted token.

A small draft model spends a large share of each token on its LM head: Qwen2.5-0.5B has 136M of its 494M weights
in the 151,936 x 896 head. Drafting only from the first `num_kept` token ids (byte-level BPE ids are in merge
order, so low ids are the frequent tokens) plus every special and added token (eos, chat markers) cuts that
share by the kept fraction. Other tokens get logit -inf: the draft never proposes them, its q over the kept ids
is still a proper distribution, and the verifier's rejection sampling stays exact for any q. Only the draft may
use this; the target's head is never cut.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class SubsetHead(nn.Module):
    """`head` restricted to `keep_ids`; returns full-vocabulary logits with -inf outside the subset."""

    def __init__(self, head: nn.Linear, keep_ids: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = head.out_features
        self.keep_ids = keep_ids
        self.head = nn.Linear(head.in_features, len(keep_ids), bias=head.bias is not None)
        with torch.no_grad():
            self.head.weight.copy_(head.weight[keep_ids])
            if head.bias is not None:
                self.head.bias.copy_(head.bias[keep_ids])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kept: torch.Tensor = self.head(hidden)                                                   # [..., num_kept]
        logits = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf"))  # [..., vocab]
        logits[..., self.keep_ids] = kept
        return logits


def kept_token_ids(vocab_size: int, num_kept: int, always: Iterable[int]) -> torch.Tensor:
    """Sorted ids: 0..num_kept-1 and `always` (special and added tokens), all < vocab_size."""
    ids = set(range(min(num_kept, vocab_size))) | {i for i in always if 0 <= i < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


def restrict_lm_head(model: nn.Module, num_kept: int, always: Iterable[int]) -> int:
    """Replaces `model.lm_head` by a SubsetHead; returns the number of ids kept (the whole head if it is no bigger)."""
    head = model.lm_head
    if not isinstance(head, nn.Linear):
        raise TypeError(f"lm_head is {type(head).__name__}, not nn.Linear")
    keep = kept_token_ids(head.out_features, num_kept, always)
    if len(keep) >= head.out_features:
        return head.out_features
    model.lm_head = SubsetHead(head, keep)
    return len(keep)
