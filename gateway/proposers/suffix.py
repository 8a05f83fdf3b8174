"""The suffix-tree proposers (`GatewayConfig.suffix_drafting`): the request's own context (`gateway/suffix_index.py`)
and the shared store of verified outputs (`kvstore/suffix_store.py`, one pipelined read). Each gives the trie below
its longest matched suffix; `speculate` turns it into a proposal with an expected-accepted score, which the suffix
rule (gateway/proposers/suffix_rule.py) weighs against the draft model. Suffix drafts are one-hot candidates, so
sampling stays exact. Only verified output tokens are written to the shared store (behind the request).
"""

from __future__ import annotations

from gateway.proposers.base import NO_DRAFT, Draft, Verified
from gateway.proposers.cache import ContinuationWriter, valid_ids
from gateway.round_spans import cache_lookup_span
from gateway.suffix_index import ContextIndex
from gateway.suffix_tree import EMPTY, Proposal, speculate, trie_from_continuations
from gateway.verify_cost import UNKNOWN_COST, VerifyCost
from kvstore.suffix_store import SuffixStore
from protos.specmesh.v1 import common_pb2

LOCAL_SOURCE = common_pb2.DRAFT_SOURCE_NGRAM     # counted under the `ngram` tier
SHARED_SOURCE = common_pb2.DRAFT_SOURCE_CACHE    # counted under the `cache` tier


def proposal_draft(proposal: Proposal, source: int) -> Draft:
    """A suffix proposal as a draft (a chain, or a tree where it branches)."""
    if not proposal.token_ids:
        return NO_DRAFT
    return Draft(proposal.token_ids, None, source, None if proposal.is_chain else proposal.parents)


class LocalSuffixProposer:
    """Proposals from the request's own context (its suffix index follows the context it is given)."""

    def __init__(self, max_branches: int = 1) -> None:
        self.max_branches = max(1, max_branches)
        self.index = ContextIndex()

    def suggest(self, context_ids: list[int], cap: int) -> Proposal:
        self.index.sync(context_ids)
        trie, length = self.index.trie(cap)
        return speculate(trie, cap, length, max_branches=self.max_branches)

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        return proposal_draft(self.suggest(context_ids, num_tokens), LOCAL_SOURCE)

    def observe(self, draft: Draft, num_accepted: int, verified: Verified,
                cost: VerifyCost = UNKNOWN_COST) -> None:
        pass


class SharedSuffixProposer:
    """Proposals from the shared store, which this request's verified output is written to as well."""

    def __init__(self, store: SuffixStore, scope: str, vocab_size: int, context_tail: int,
                 max_branches: int = 1) -> None:
        self.store, self.scope, self.vocab_size = store, scope, vocab_size
        self.max_branches = max(1, max_branches)
        self.writer = ContinuationWriter(store, scope, context_tail)

    async def suggest(self, context_ids: list[int], cap: int) -> Proposal:
        """The best proposal over the store's matched suffixes (one read for all of them)."""
        with cache_lookup_span() as span:
            hits = await self.store.lookup_counts(self.scope, context_ids)
            best = EMPTY
            for length, continuations in hits:                       # longest suffix first: it wins ties
                trie = trie_from_continuations((valid_ids(c, self.vocab_size), n) for c, n in continuations)
                proposal = speculate(trie, cap, length, max_branches=self.max_branches)
                if proposal.score > best.score:
                    best = proposal
            span.set_attribute("specmesh.cache.draft_tokens", len(best.token_ids))
        return best

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        return proposal_draft(await self.suggest(context_ids, num_tokens), SHARED_SOURCE) if num_tokens > 0 \
            else NO_DRAFT

    def observe(self, draft: Draft, num_accepted: int, verified: Verified,
                cost: VerifyCost = UNKNOWN_COST) -> None:
        self.writer.observe(verified)

    def close(self) -> None:
        self.writer.close()
