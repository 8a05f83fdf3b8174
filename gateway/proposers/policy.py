"""The drafter a generation uses: a request's proposers, the rule that picks the round's draft among them (the
tiers' order, or suffix drafting's choice) and the round cost model both read. Built in one place
(gateway/proposers/compose.py); whoever needs the cost model asks `policy.cost_model`.
"""

from __future__ import annotations

from typing import Protocol

from gateway.proposers.base import Draft, ModelProposer, Verified
from gateway.proposers.cost_model import RoundCostModel
from gateway.proposers.proposer_set import ProposerSet
from gateway.verify_cost import UNKNOWN_COST, VerifyCost
from protos.specmesh.v1 import common_pb2


class Rule(Protocol):
    """Which proposer drafts the round (`TierOrder`, `SuffixRule`)."""

    async def propose(self, context_ids: list[int], num_tokens: int, room: int) -> Draft: ...

    def model_part(self, draft: Draft) -> Draft:
        """The part of `draft` the draft model proposed (what its prefetch continues)."""


class ProposerPolicy:
    """A `Drafter`. The request's budget and tokens are not kept here: each call brings them (`room`, `Verified`)."""

    def __init__(self, proposers: ProposerSet, rule: Rule, cost_model: RoundCostModel) -> None:
        self.proposers, self.rule, self.cost_model = proposers, rule, cost_model

    @property
    def model(self) -> ModelProposer | None:
        """The draft model behind the policy (gateway/keepalive.py renews its draft session)."""
        return self.proposers.model

    async def prefill(self, prompt_ids: list[int], num_tokens: int) -> None:
        await self.proposers.prefill_model(prompt_ids, num_tokens)   # (suffix drafting: no model round meanwhile)

    def prefetch(self, context_ids: list[int], draft: Draft, num_tokens: int) -> None:
        """Only a model-drafted round continues the draft service's own block (see ModelDrafter.prefetch)."""
        model, draft = self.proposers.model, self.rule.model_part(draft)
        if model is not None and draft.source == common_pb2.DRAFT_SOURCE_MODEL:
            model.prefetch(context_ids, draft, num_tokens)
            self.proposers.stats.prefetch_sent += model.prefetching

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        """num_tokens is the draft model's length; room the most draft tokens worth verifying (None: num_tokens)."""
        return await self.rule.propose(context_ids, num_tokens, num_tokens if room is None else room)

    def observe(self, draft: Draft, num_accepted: int, verified: Verified,
                cost: VerifyCost = UNKNOWN_COST) -> None:
        """Counters and the proposers' own bookkeeping (the cache writes); learning is the cost model's, fed by the
        round loop (`RoundCostModel.observe`)."""
        counters = self.proposers.stats.tier(draft.source)
        if counters is not None:
            counters.drafted += len(draft.token_ids)
            counters.accepted += num_accepted
        ps = self.proposers
        for proposer in (ps.cache, ps.ngram, ps.local_suffix, ps.shared_suffix):   # (the model: its next Propose
            if proposer is not None:                                                # carries the verified tokens)
                proposer.observe(draft, num_accepted, verified, cost)

    async def close(self) -> None:
        ps = self.proposers
        await ps.cancel_sync()                           # a resend or catch-up still running is not needed
        for writer in (ps.cache, ps.shared_suffix):
            if writer is not None:
                writer.close()                   # the last positions, with shorter continuations
        if ps.model is not None:
            await ps.model.close()
            ps.count_bytes()
