"""The default rule: the draft cache, then n-gram lookup in the request's own context, then the draft model.

The first tier with a proposal drafts the round. Cache and n-gram drafts are free (no draft compute), so they fill
the room left, up to their caps as the round cost model prices them (`RoundCostModel.local_room`); a round that
skips the draft service leaves its session behind, and the next Propose sends every token since the last sync.
"""

from __future__ import annotations

from gateway.proposers.base import NO_DRAFT, Draft
from gateway.proposers.cache import CACHE
from gateway.proposers.cost_model import RoundCostModel
from gateway.proposers.ngram import NGRAM
from gateway.proposers.proposer_set import ProposerSet


class TierOrder:
    def __init__(self, proposers: ProposerSet, cost_model: RoundCostModel) -> None:
        self.proposers, self.cost_model = proposers, cost_model

    async def propose(self, context_ids: list[int], num_tokens: int, room: int) -> Draft:
        """num_tokens is the draft model's length; local drafts fill the room."""
        if room <= 0:
            return NO_DRAFT
        ps = self.proposers
        for source, local in ((CACHE, ps.cache), (NGRAM, ps.ngram)):
            if local is not None and (n := self.cost_model.local_room(source, room)) > 0:
                draft = await local.propose(context_ids, n)
                if ps.count(source, draft.token_ids):
                    return draft
        return await ps.from_model(context_ids, num_tokens)

    def model_part(self, draft: Draft) -> Draft:
        return draft                              # a model round's draft is all the model's
