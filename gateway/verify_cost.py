"""What the verifier reports about its forward's cost and load, as the gateway prices drafts with it.

A verify of k drafts is a forward of k + 1 tokens (the drafts and the pending token). The verifier measures
(VerifyResponse.token_cost, .free_tokens):

    verify(k) = verify(0) * (1 + token_cost * excess(k)),    excess(k) = max(0, k + 1 - free_tokens)

free_tokens: a forward of up to that many tokens costs about what one does (measured: 4 for the int4 kernel on a
full-width AVX2 core, where 4 rows of integer dot products take the time the weights take to stream; 1 where the
kernel is compute-bound); token_cost what each token beyond them adds, relative to verify(0).

Load: the forward that verified a block may carry other sessions' rows too (VerifyResponse.num_other_rows) and
emit tokens for them (.num_other_tokens). In units of a one-token forward (s = token_cost, F = free_tokens), a
forward of n rows costs

    t(n) = min(n, 1) + s * max(0, n - F)            (t(0) = 0: no forward; linear between 0 and 1 row, so that a
                                                     smoothed fraction of a row prices smoothly)

With the verifier the shared resource, the other sessions yield rho = E_o / t(n_o) tokens per unit of its time
(E_o tokens from n_o rows in a forward of their own), and a session that puts k + 1 rows beside them takes
t(n_o + k + 1) - t(n_o) of that time, so the others give up

    P(k) = E_o * (t(n_o + k + 1) - t(n_o)) / t(n_o)        tokens per round of this session        (`load_penalty`)

P(k) = 0 without other rows (one stream). F = 1, compute-bound, target-only neighbours (E_o = n_o): each of this
session's rows costs them s / (1 + s (n_o - 1)) tokens, approaching 1 as n_o grows: a drafted row then pays only
if it is accepted about as surely as a target-only row emits a token. Within the free rows (n_o + k + 1 <= F)
drafts cost the others nothing.

Work still queued when the forward finished (VerifyResponse.num_waiting) waited for all of it, this session's rows
included: sessions whose verifies alternate between forwards instead of sharing one. Each such item counts as one
more row beside this session's, worth one token (a target-only row: the least a waiting verify brings), so drafts
are not free beside a busy verifier's queue (`reported`). So does every other session the replica holds, and every
other row is worth at least a token (a prefill chunk's row brings a first token closer): `reported`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.decayed_line import DecayedLine


@dataclass(frozen=True)
class VerifyCost:
    token_cost: float = 0.0      # one more token beyond the free ones, relative to a one-token verify (0 = unknown)
    free_tokens: int = 1         # >= 1: tokens a forward takes for about the cost of one (0 on the wire reads as 1)
    forward_rows: int = 0        # rows of the forward that verified the block, all sessions (0 = no forward ran)
    other_rows: int = 0          # ... of them other sessions' (0 also from a verifier that does not report it)
    other_tokens: int = 0        # tokens the forward emitted for those other sessions


def reported(token_cost: float, free_tokens: int, forward_rows: int, other_rows: int, other_tokens: int,
             num_waiting: int, num_sessions: int = 0) -> VerifyCost:
    """The cost and load a VerifyResponse reports (free_tokens 0, from an older verifier, reads as 1), when a forward
    ran (none: no load sample):
    - queued work counts as other rows (a row and a token per item);
    - so does every other session the replica holds (`num_sessions`, this one included; 0 = not reported) beyond
      those: a session away drafting is missing from the forward that verified this block, not from the next ones
      (the forward's own rows alone made the load look light exactly while the others drafted, inviting more);
    - every other row counts as work the others need, at least a token's worth: a prompt's chunk brings its first
      token closer, a draft row its verdict. Priced by emitted tokens alone, a forward of prefill chunks (16 prompts
      arriving together: 92 other rows, 28 tokens) made drafts beside it look cheap while they delayed every prompt."""
    if forward_rows <= 0:
        return VerifyCost(token_cost, max(1, free_tokens), forward_rows, other_rows, other_tokens)
    others = max(0, num_sessions - 1)
    rows = max(other_rows + num_waiting, others)
    return VerifyCost(token_cost, max(1, free_tokens), forward_rows, rows, max(other_tokens + num_waiting, rows))


class LoadReport(Protocol):
    """The cost and load fields StartSessionResponse and VerifyResponse share."""
    token_cost: float
    free_tokens: int
    num_batch_tokens: int
    num_other_rows: int
    num_other_tokens: int
    num_waiting: int
    num_sessions: int


def reported_by(response: LoadReport) -> VerifyCost:
    """`reported` of a StartSessionResponse or a VerifyResponse."""
    return reported(response.token_cost, response.free_tokens, response.num_batch_tokens, response.num_other_rows,
                    response.num_other_tokens, response.num_waiting, response.num_sessions)


def excess_tokens(num_drafts: int, free_tokens: int) -> int:
    """Tokens of a verify of `num_drafts` drafts that cost extra."""
    return max(0, num_drafts + 1 - free_tokens)


def forward_units(num_rows: float, token_cost: float, free_tokens: int) -> float:
    """t(n): a forward of `num_rows` rows in units of a one-token forward (0 rows: 0)."""
    return min(max(num_rows, 0.0), 1.0) + token_cost * max(0.0, num_rows - free_tokens)


def load_penalty(num_drafts: int, other_rows: float, other_tokens: float, token_cost: float,
                 free_tokens: int) -> float:
    """P(k): tokens the other sessions give up for a round of `num_drafts` drafts beside their rows."""
    alone = forward_units(other_rows, token_cost, free_tokens)
    if alone <= 0 or other_tokens <= 0:
        return 0.0
    taken = forward_units(other_rows + num_drafts + 1, token_cost, free_tokens) - alone
    return other_tokens * taken / alone


UNKNOWN_COST = VerifyCost()


class VerifyLine:
    """verify(k) of the adaptive draft length (gateway/adaptive.py): a decayed least-squares fit t = v0 + v1 * x(k)
    (x: verified tokens beyond the free ones), with a prior relative slope when x has no spread; a relative slope the
    verifier measured itself (`measured_slope` > 0) is used instead of the fitted one. Beside other sessions' rows
    (`other_rows` > 0) a measured slope scales the forward t(n)."""

    def __init__(self, decay: float, rel_slope: float) -> None:
        self.rel_slope = rel_slope
        self.measured_slope = 0.0
        self.free_tokens = 1
        self.other_rows = 0.0
        self.points = DecayedLine(decay)
        self._k_sum = self._k_weight = 0.0          # decayed drafts verified (this request's rounds only)

    def add(self, k: int, t: float) -> None:
        self.points.add(excess_tokens(k, self.free_tokens), t)
        d = self.points.decay
        self._k_sum, self._k_weight = d * self._k_sum + k, d * self._k_weight + 1

    @property
    def slope_units(self) -> float:
        """s: one more token's cost relative to a one-token forward (measured, else the prior)."""
        return self.measured_slope or self.rel_slope

    def __call__(self, k: int) -> float | None:
        moments = self.points.moments()
        if moments is None:
            return None
        x = excess_tokens(k, self.free_tokens)
        mean_x, mean_t, var_x = moments
        if self.measured_slope > 0 and self.other_rows > 0 and self._k_weight > 0:
            s, free, mean_k = self.measured_slope, self.free_tokens, self._k_sum / self._k_weight
            return mean_t * forward_units(self.other_rows + k + 1, s, free) / \
                forward_units(self.other_rows + mean_k + 1, s, free)
        if self.measured_slope > 0 or var_x < 0.25:   # measured, or (almost) a single x seen: scale the mean
            s = self.measured_slope or self.rel_slope
            return mean_t * (1 + s * x) / (1 + s * mean_x)
        slope = max(0.0, self.points.slope())
        return max(0.0, mean_t + slope * (x - mean_x))

