"""Prompt-lookup guesses in a forward's free rows: an engine speculates on its own while it runs one token anyway.

A forward that decodes one token per sequence leaves rows nearly free on a CPU whose kernel streams the weights once
for a few rows: Qwen2.5-1.5B int4 on one core, 100 ms for 1 to 4 tokens on an AVX2 Zen 3, 50 ms for 1 token and
~9 ms per further token on a Zen 4 with AVX-512 VNNI; the 0.5B draft there 19.5 ms for 1 token, 26 for 4. Those rows
carry prompt-lookup guesses (`specmesh/spec/ngram.py`: what followed the context's last n-gram earlier in the same
context), checked greedily in the same forward: every guess equal to the model's argmax is a token the model would
have emitted next, so the forward moves several tokens on repetitive text (code edits, quotes, lists) and the
output is exactly one-token-at-a-time greedy's. Two engines use them: the verifier while it decodes ahead
(verifier_service/decode_ahead.py: the target's tokens, exact) and the draft service while it drafts
(draft_service/engine.py: more drafts per draft forward).

How many guesses a forward carries is priced like a draft length: with a the guesses' acceptance rate (each one
given the ones before it, `GuessRate`, per session) and t(n) = 1 + token_cost * max(0, n - F) the forward's cost in
one-token forwards (the engine's own measure, `specmesh/engine/forward_cost.py`), g guesses beside `rows` rows
(one token each) make the forward yield rows + a + ... + a^g tokens for t(rows + g) / t(rows) its cost; the engine
takes the g with the most tokens per cost. Beside other sessions' rows a guess must be likelier: a forward of 8
one-token rows on a compute-bound core (token_cost 0.2) takes one only at a > 0.67, where priced against this
session's one token alone it took any with a > 0.08 (ahead steps of 8 streams carried ~2 guess rows each, ~10% of
the verifier's time).
Where the engine has recent forwards of a size, their mean prices that size instead of the line (`ForwardCost.seconds`):
the int4 AVX-512 kernel on 2 threads takes 68 ms for 8 rows and 82 for 9, a row past its 8-row tile, where the line
says 73; ahead steps of 8 streams carried a guess row in a fifth of their forwards, for ~3% of the verifier's time.
Until the cost is measured, an extra row is priced at a quarter of a forward (`PRIOR_FIT`): the guesses' own forwards
then give the measure its spread in size.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from specmesh.engine.forward_cost import UNKNOWN, Fit
from specmesh.spec.ngram import propose_ngram

MAX_GUESSES = 7            # guesses per session and step (at most what the ahead limit leaves)
NGRAM_SIZES = (4, 3, 2)    # tail n-grams looked up, longest first
DECAY = 0.9                # weight old counts keep per forward that guessed (memory ~10 guessing forwards)
RELAX = 0.98               # ... per forward without guesses, drifting back toward the prior (memory ~50 forwards)
PRIOR_HITS, PRIOR_TRIES = 1.0, 2.0
PRIOR_FIT = Fit(0.25, 1, 0.0)   # the cost of an extra row until measured (compute-bound AVX2 Zen 1: ~0.45)
# Guesses must raise the forward's tokens per second by this share, not merely break even: the per-size means that
# price them move by a few percent with the host, and a session's rate drifts back to its prior of one in two. At 8
# streams of the real pair (2-core Intel, int4) rows priced at break even made ahead steps carry ~0.4 guess rows a
# forward, ~200 a pass of 4,096 tokens that found few tokens: the defaults 0.93-0.97x of target-only, against
# 0.98-1.01x with no guesses at all.
MARGIN = 0.05


@dataclass
class GuessRate:
    """Decayed counts of a session's guesses: accepted, and tried (accepted plus the first rejected one; guesses
    past it were never judged). A new session starts at the prior (one of two); a step without guesses moves the
    counts back toward it, so a session that stopped guessing tries again later."""

    hits: float = PRIOR_HITS
    tries: float = PRIOR_TRIES

    @property
    def rate(self) -> float:
        return self.hits / self.tries

    def observe(self, num_guessed: int, num_accepted: int) -> None:
        if num_guessed:
            self.hits = DECAY * self.hits + num_accepted
            self.tries = DECAY * self.tries + num_accepted + (num_accepted < num_guessed)
        else:            # slowly: text whose guesses missed (chat) rarely turns repetitive within a few tokens
            self.hits = RELAX * self.hits + (1 - RELAX) * PRIOR_HITS
            self.tries = RELAX * self.tries + (1 - RELAX) * PRIOR_TRIES


def best_num_guesses(rate: float, fit: Fit, num_rows: int, max_guesses: int,
                     measured: Callable[[int], float | None] | None = None) -> int:
    """The g <= max_guesses with the most expected tokens per cost when the forward already runs num_rows tokens
    (this session's pending token included), each worth a token; none unless that beats no guess by MARGIN.
    measured(n): the engine's recent forwards of n tokens, in seconds (`ForwardCost.seconds`): a size's forwards
    price it where they are dearer than the line, the line only the sizes between measured ones (a row past the
    kernel's tile costs a fifth of the forward, not the line's fifteenth)."""
    if max_guesses <= 0:
        return 0
    if fit == UNKNOWN:
        fit = PRIOR_FIT

    def cost(n: int) -> float:
        return 1.0 + fit.token_cost * max(0, n - fit.free_tokens)

    def seconds(n: int) -> float | None:
        """t(n): measured, else the line from the largest measured size below n (None: none measured)."""
        if measured is None:
            return None
        for m in range(n, 0, -1):
            t = measured(m)
            if t:
                return t * cost(n) / cost(m)
        return None

    now = seconds(num_rows)

    def growth(n: int) -> float:
        """t(n) / t(num_rows): the measured sizes' where they price the rows dearer than the line (a kernel's tile
        boundary), never cheaper (two sizes' means a few percent apart from the host's noise made rows look free)."""
        line = cost(n) / cost(num_rows)
        then = seconds(n) if now else None
        return max(line, then / now) if now and then else line

    best, best_value = 0, 1.0 + MARGIN
    for g in range(1, min(max_guesses, MAX_GUESSES) + 1):
        value = (num_rows + sum(rate ** i for i in range(1, g + 1))) / num_rows / growth(num_rows + g)
        if value > best_value + 1e-9:
            best, best_value = g, value
    return best


def guess(context_ids: Sequence[int], max_guesses: int, eos_token_ids: Collection[int]) -> list[int]:
    """Up to max_guesses prompt-lookup tokens after context_ids, cut before the first end of sequence (nothing is
    decoded ahead past one)."""
    guesses = propose_ngram(context_ids, NGRAM_SIZES, min(max_guesses, MAX_GUESSES))
    for i, token in enumerate(guesses):
        if token in eos_token_ids:
            return guesses[:i]
    return guesses
