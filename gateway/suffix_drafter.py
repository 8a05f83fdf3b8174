"""Suffix drafting (`GatewayConfig.suffix_drafting`): one model-free proposer over the request's own context and
the shared store of verified outputs, in place of the draft cache and n-gram tiers.

Each round: the request's context index (`gateway/suffix_index.py`) and the shared store (`kvstore/
suffix_store.py`, one pipelined read) each give the trie below their longest matched suffix; `speculate` turns each
into a proposal with an expected-accepted score; `ProposerChoice` picks the local proposal, the shared one, the
draft model or nothing by expected tokens per millisecond. With tree drafts on (`draft_tree_width` > 0) suffix
proposals branch where two continuations are both frequent, and a model round carries the best suffix proposal
as further branches of the same tree. Suffix drafts are one-hot candidates, so sampling stays exact. Only
verified output tokens are written to the shared store (as the draft cache did, behind the request).

Counters: local suffix rounds count under the `ngram` tier, shared-store rounds under `cache`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.draft_tree import main_chain_len
from gateway.drafters import NO_DRAFT, Draft, ModelDrafter, Verified
from gateway.round_spans import cache_lookup_span
from gateway.suffix_choice import GLOBAL, LOCAL, MODEL, ProposerChoice
from gateway.suffix_index import ContextIndex
from gateway.suffix_tree import EMPTY, Proposal, accepted_nodes, speculate, trie_from_continuations
from gateway.tiers import TieredDrafter
from gateway.verify_cost import UNKNOWN_COST, VerifyCost
from kvstore.base import MAX_CONTINUATION_TOKENS
from protos.specmesh.v1 import common_pb2
from specmesh.spec.rejection import SparseDist
from specmesh.spec.token_ids import common_prefix_len

if TYPE_CHECKING:
    from gateway.tiers import DraftTiers
    from kvstore.suffix_store import SuffixStore

SOURCES = {LOCAL: common_pb2.DRAFT_SOURCE_NGRAM, GLOBAL: common_pb2.DRAFT_SOURCE_CACHE,
           MODEL: common_pb2.DRAFT_SOURCE_MODEL}


@dataclass(frozen=True)
class _Round:
    """What a round drafted, to learn from once it is verified."""
    proposer: str                    # LOCAL, GLOBAL or MODEL
    suffix_from: str                 # LOCAL or GLOBAL: where `suffix` came from
    suffix: Proposal                 # the suffix part of the draft (all of it, or the branches beside the model's)
    draft: Draft
    model_len: int                   # the draft model's chain: the draft's first model_len nodes
    sent_at: float                   # perf_counter when the draft left for the verifier
    context_len: int                 # verified tokens before the round (its accepted drafts come right after)


class SuffixDrafter(TieredDrafter):
    def __init__(self, tiers: DraftTiers, scope: str, model: ModelDrafter | None, store: SuffixStore | None,
                 max_branches: int = 1) -> None:
        super().__init__(tiers, scope, model, store)  # type: ignore[arg-type]
        self.store = store
        self.max_branches = max(1, max_branches)
        self.index = ContextIndex()
        self.choice = ProposerChoice()
        self._round: _Round | None = None
        if getattr(model, "tree_width", 0) > 0 and getattr(model, "tree_pricing", None) is None:
            # no adaptive draft length to price the model's tree width: the choice's model estimates do it
            model.tree_pricing = self.choice.model.tree_width        # type: ignore[union-attr]

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        self._round = None
        room = num_tokens if room is None else room
        cap = min(room, self.settings.local_max_tokens)
        proposals = {LOCAL: self._local(context_ids, cap), GLOBAL: await self._shared(context_ids, cap)}
        proposals = {p: self.choice.trimmed(p, prop) for p, prop in proposals.items()}
        options = {p: (self.choice.expected_suffix(p, prop), len(prop.token_ids))
                   for p, prop in proposals.items() if prop.token_ids}
        if self.model is not None and num_tokens > 0 and self._model_round_allowed():
            options[MODEL] = (self.choice.expected_model(num_tokens), num_tokens)
        best = self.choice.choose(options) if options else None
        suffix_from = max((LOCAL, GLOBAL), key=lambda p: options.get(p, (0.0, 0))[0])     # LOCAL on a tie
        model_len, draft = 0, NO_DRAFT
        if best == MODEL:
            started = time.perf_counter()
            draft = await self._from_model(context_ids, num_tokens)
            self.choice.observe_cost(MODEL, time.perf_counter() - started)
            model_len = len(draft.token_ids)
            if not draft.token_ids and proposals[suffix_from].token_ids:
                best = suffix_from                       # the draft service failed or was overtaken this round
            elif self.max_branches > 1:
                draft = with_branches(draft, proposals[suffix_from])
        if best in (LOCAL, GLOBAL):
            suffix_from, suffix = best, proposals[best]
            draft = Draft(suffix.token_ids, None, SOURCES[best], None if suffix.is_chain else suffix.parents)
        for p in (LOCAL, GLOBAL):
            self._count(SOURCES[p], proposals[p].token_ids if best == p else [])
        with_suffix_nodes = best != MODEL or len(draft.token_ids) > model_len
        self.tiers.stats.tree_drafts += draft.parents is not None and with_suffix_nodes
        if best is not None and draft.token_ids:
            self._round = _Round(best, suffix_from, proposals[suffix_from], draft, model_len,
                                 time.perf_counter(), len(context_ids))
        return draft

    def _model_round_allowed(self) -> bool:
        """False while the draft link backs off after a failure. Each such round uses one backoff round up, as
        `ModelDrafter.propose` does: a round that never asked the model would leave it locked out for good."""
        link = getattr(self.model, "link", None)
        return link.round_allowed() if link is not None else getattr(self.model, "skip_rounds", 0) == 0

    def prefetch(self, context_ids: list[int], draft: Draft, num_tokens: int) -> None:
        """The draft service continues only its own chain (not the suffix branches beside it)."""
        done = self._round
        if done is not None and done.draft is draft and draft.parents is not None and done.model_len:
            dists = draft.dists[:done.model_len] if draft.dists is not None else None
            draft = Draft(draft.token_ids[:done.model_len], dists, draft.source)
        super().prefetch(context_ids, draft, num_tokens)

    def _local(self, context_ids: list[int], cap: int) -> Proposal:
        started = time.perf_counter()
        self.index.sync(context_ids)
        trie, length = self.index.trie(cap)
        proposal = speculate(trie, cap, length, max_branches=self.max_branches)
        self.choice.observe_cost(LOCAL, time.perf_counter() - started)
        return proposal

    async def _shared(self, context_ids: list[int], cap: int) -> Proposal:
        """The best proposal over the shared store's matched suffixes (one read for all of them)."""
        if self.store is None or cap <= 0:
            return EMPTY
        started = time.perf_counter()
        with cache_lookup_span() as span:
            hits = await self.store.lookup_counts(self.scope, context_ids)
            best = EMPTY
            for length, continuations in hits:                       # longest suffix first: it wins ties
                trie = trie_from_continuations((self._valid(c), n) for c, n in continuations)
                proposal = speculate(trie, cap, length, max_branches=self.max_branches)
                if proposal.score > best.score:
                    best = proposal
            span.set_attribute("specmesh.cache.draft_tokens", len(best.token_ids))
        self.choice.observe_cost(GLOBAL, time.perf_counter() - started)
        return best

    def observe(self, draft: Draft, num_accepted: int, verified: Verified,
                cost: VerifyCost = UNKNOWN_COST) -> None:
        counters = self.tiers.stats.tier(draft.source)
        if counters is not None:
            counters.drafted += len(draft.token_ids)
            counters.accepted += num_accepted
        if self._round is not None and self._round.draft is draft:
            self._learn(self._round, num_accepted, verified, cost)
        self._round = None
        self._verified = verified
        self._record(len(verified.output_ids) - MAX_CONTINUATION_TOKENS)

    def _learn(self, done: _Round, num_accepted: int, verified: Verified, cost: VerifyCost) -> None:
        """Feeds the round's measurements to the choice: verify time and the verifier's cost of one more token, and
        acceptance of what each part drafted."""
        verify_s = time.perf_counter() - done.sent_at
        self.choice.observe_verify(len(done.draft.token_ids), verify_s, cost)
        # (a verifier that decoded ahead may send more than one target token after the accepted drafts)
        start = done.context_len - len(verified.prompt_ids)
        accepted_ids = list(verified.output_ids[start:start + num_accepted])
        if done.proposer == MODEL:
            # the model's own chain (a tree from the draft service puts its alternatives after the chain)
            chain_len = main_chain_len(done.draft.parents, done.model_len)
            chain = done.draft.token_ids[:chain_len]
            accepted_on_chain = common_prefix_len(chain, accepted_ids)
            self.choice.observe_model(len(chain), accepted_on_chain, self.choice.cost_s(MODEL, len(chain)), verify_s)
            if done.model_len > chain_len:
                self.choice.model.observe_tree(done.model_len - chain_len, num_accepted > accepted_on_chain)
        if done.proposer != MODEL or len(done.draft.token_ids) > done.model_len:
            self.choice.observe_suffix(done.suffix_from, done.suffix, accepted_nodes(done.suffix, accepted_ids))


def with_branches(draft: Draft, suffix: Proposal) -> Draft:
    """The model's chain as the first branch, then the suffix proposal's nodes as further branches of the same
    tree (a suffix node equal to a model node at the same place is dropped: the model's node stands for it)."""
    if not draft.token_ids or not suffix.token_ids or draft.parents is not None:
        return draft
    chain = draft.token_ids
    tokens, parents = list(chain), list(range(-1, len(chain) - 1))
    where: dict[int, int] = {}                              # suffix node -> its node in the merged tree
    for i, (t, p) in enumerate(zip(suffix.token_ids, suffix.parents, strict=True)):
        parent = where[p] if p >= 0 else -1                 # parents come first (topological order)
        if parent + 1 < len(chain) and tokens[parent + 1] == t:   # the model's chain already has this node
            where[i] = parent + 1
            continue
        where[i] = len(tokens)
        tokens.append(t)
        parents.append(parent)
    if len(tokens) == len(chain):
        return draft
    dists = None
    if draft.dists is not None:                             # one-hot q for the suffix's deterministic candidates
        dists = list(draft.dists[:len(chain)]) + [SparseDist((t,), (1.0,)) for t in tokens[len(chain):]]
    return Draft(tokens, dists, draft.source, parents)

