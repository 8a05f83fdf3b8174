"""What a gateway's finished requests learned about speculation, to start new requests from.

Each request's round cost model (gateway/proposers/cost_model.py: its draft-length controller, gateway/adaptive.py,
and in suffix mode its proposer choice, gateway/suffix_choice.py) learns from nothing: the draft model's cost per
token, the verify line, the link's round trip, acceptance per position, how far the suffix proposals' count ratios
can be trusted. A short request spends a large share of its rounds on
that (at the request's full k, a CPU round of the real pair costs ~1 s for ~2 tokens), and then ends. Here the
gateway keeps books of the decayed sums of the requests that ended, one per tenant and one for the whole gateway
(each split by whether the request samples):

    book[key] = keep * book[key] + sums of the request that ended        (keep = 0.5 per finished request)

and a new request starts from its tenant's book, or the gateway's while its tenant has none, scaled to at most
`max_rounds` rounds of evidence, so its own rounds outweigh the prior within a few rounds (its content may differ
from the last requests'). Costs are the same for every request on this deployment; acceptance is only a head start.
So the first sampled request after greedy ones (a gateway warmed up greedy, then sampled traffic) starts its proposer
choice from the greedy book's costs, without their acceptance: with the draft model on the verifier's 2 cores it
otherwise made the draft prefill and model trials a measured cost rules out (guidellm's first request at
temperature 1: 70 ms a token against the others' 43-47).
The books hold counts and timings, never token ids. Nothing here is a tensor or a clock: plain floats, dicts, used
from the event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from gateway.choice_memory import ChoiceMemory
from gateway.controller_memory import ControllerMemory
from gateway.proposers.cost_model import CostModelMemory, RoundCostModel
from gateway.suffix_choice import MODEL

KEEP = 0.5          # weight of the book's evidence per request that ends
MAX_ROUNDS = 3.0    # a new request starts with at most this many rounds' worth of the book's evidence
# Every this many requests one starts without the book's draft model cost ("unmeasured = free", suffix_choice.py): a
# model whose measured cost says it could not pay is not tried again (`could_pay`: under load, or on the verifier's
# cores), so a cost measured once on a busy moment would otherwise keep it out for good. That request makes the
# draft prefill and its trials where the load allows them, and what it measures goes back into the book. Only requests
# that start alone count: beside others the trials' compute is taken from the other streams (8 streams of the real
# pair, 2-core Zen 4: one explorer a pass of 16 requests, two 281 ms model rounds and a draft prefill, 0.55-0.77 s of
# the draft service's CPU on the verifier's cores against ~0 in target-only's passes), and a cost measured under load
# would say "cannot pay" again.
EXPLORE_EVERY = 16


M = TypeVar("M", ControllerMemory, ChoiceMemory)


@dataclass(frozen=True)
class PriorKey:
    tenant: str          # "" without tenants
    sampled: bool        # sampled requests accept fewer drafts than greedy ones

    @property
    def gateway_wide(self) -> PriorKey:
        return PriorKey(GATEWAY, self.sampled)

    @property
    def other_sampling(self) -> PriorKey:
        return PriorKey(self.tenant, not self.sampled)


GATEWAY = "*"            # the book of every tenant's requests (not a tenant name: tenants are validated tokens)


class LearnedPriors:
    def __init__(self, keep: float = KEEP, max_rounds: float = MAX_ROUNDS) -> None:
        if not 0.0 <= keep < 1.0 or max_rounds <= 0:
            raise ValueError(f"need 0 <= keep < 1 and max_rounds > 0, got {keep}, {max_rounds}")
        self.keep, self.max_rounds = keep, max_rounds
        self._controllers: dict[PriorKey, ControllerMemory] = {}
        self._choices: dict[PriorKey, ChoiceMemory] = {}
        self._num_alone = 0              # requests started with no other running (exploration counts these)

    def start(self, key: PriorKey, model: RoundCostModel, alone: bool = True) -> None:
        """Seeds a new request's cost model from its tenant's book, else the gateway's; with neither for its kind
        (greedy or sampled), its proposer choice starts from the other kind's costs without their acceptance (a
        sampled request after greedy ones knows what a draft model round costs here, and so does not make the draft
        prefill and trials that one measured would rule out); else from its own priors. Of the requests that start
        `alone` (no other request running at the gateway), every EXPLORE_EVERY-th without the draft model's cost."""
        self._num_alone += alone
        choice = _book(self._choices, key)
        if choice is None:                  # costs are the deployment's: the other sampling kind's, acceptance apart
            other = _book(self._choices, key.other_sampling)
            choice = other.costs_only() if other is not None else None
        if choice is not None and alone and self._num_alone % EXPLORE_EVERY == 0:
            choice = choice.without_cost(MODEL)
        model.remember(CostModelMemory(_book(self._controllers, key), choice), self.max_rounds)

    def finish(self, key: PriorKey, model: RoundCostModel) -> None:
        """Adds what an ended request's cost model measured to its tenant's book and the gateway's (a request that
        ran no round adds nothing)."""
        memory = model.memory()
        for book_key in {key, key.gateway_wide}:
            if memory.length is not None:
                self._controllers = _added(self._controllers, book_key, memory.length, self.keep)
            if memory.choice is not None:
                self._choices = _added(self._choices, book_key, memory.choice, self.keep)

    def rounds(self, key: PriorKey) -> tuple[float, float]:
        """(controller, choice) rounds of evidence the book holds for `key` (for tests and metrics)."""
        c, p = self._controllers.get(key), self._choices.get(key)
        return (c.rounds if c else 0.0, p.rounds if p else 0.0)


def _book(books: dict[PriorKey, M], key: PriorKey) -> M | None:
    return books.get(key, books.get(key.gateway_wide))


def _added(book: dict[PriorKey, M], key: PriorKey, memory: M, keep: float) -> dict[PriorKey, M]:
    if memory.rounds <= 0:
        return book
    old = book.get(key)
    return {**book, key: memory if old is None else old.scaled(keep).plus(memory)}
