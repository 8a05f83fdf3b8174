"""What the verifier reports about its forward's cost, as the gateway prices drafts with it.

A verify of k drafts is a forward of k + 1 tokens (the drafts and the pending token). The verifier measures
(VerifyResponse.token_cost, .free_tokens):

    verify(k) = verify(0) * (1 + token_cost * excess(k)),    excess(k) = max(0, k + 1 - free_tokens)

free_tokens: a forward of up to that many tokens costs about what one does (measured: 4 for the int4 kernel on a
full-width AVX2 core, where 4 rows of integer dot products take the time the weights take to stream; 1 where the
kernel is compute-bound); token_cost what each token beyond them adds, relative to verify(0).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyCost:
    token_cost: float = 0.0      # one more token beyond the free ones, relative to a one-token verify (0 = unknown)
    free_tokens: int = 1         # >= 1: tokens a forward takes for about the cost of one (0 on the wire reads as 1)


def excess_tokens(num_drafts: int, free_tokens: int) -> int:
    """Tokens of a verify of `num_drafts` drafts that cost extra."""
    return max(0, num_drafts + 1 - free_tokens)


UNKNOWN_COST = VerifyCost()
