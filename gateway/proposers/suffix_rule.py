"""Suffix drafting's rule (`GatewayConfig.suffix_drafting`): each round, the request's context index and the shared
store each give a proposal (gateway/proposers/suffix.py); the round cost model's `ProposerChoice` picks the local
proposal, the shared one, the draft model or nothing by expected tokens per second. With tree drafts on
(`draft_tree_width` > 0) suffix proposals branch where two continuations are both frequent, and a model round
carries the best suffix proposal as further branches of the same tree.

Counters: local suffix rounds count under the `ngram` tier, shared-store rounds under `cache`.
"""

from __future__ import annotations

import time

from gateway.proposers.base import NO_DRAFT, Draft
from gateway.proposers.cost_model import RoundCostModel, SuffixRound
from gateway.proposers.proposer_set import ProposerSet
from gateway.proposers.suffix import LOCAL_SOURCE, SHARED_SOURCE
from gateway.suffix_choice import GLOBAL, LOCAL, MODEL, ProposerChoice
from gateway.suffix_tree import EMPTY, Proposal
from protos.specmesh.v1 import common_pb2
from specmesh.spec.rejection import SparseDist

# The most verified tokens a model round's Propose brings the draft service; more are sent in the background. A
# round after one suffix round brings its accepted tokens plus up to 8 decoded ahead; a catch-up of 32 costs the
# 0.5B draft ~0.3 s on one AVX2 core, a few of a stream's gaps.
CATCH_UP_IN_ROUND = 32

SOURCES = {LOCAL: LOCAL_SOURCE, GLOBAL: SHARED_SOURCE, MODEL: common_pb2.DRAFT_SOURCE_MODEL}


class SuffixRule:
    def __init__(self, proposers: ProposerSet, cost_model: RoundCostModel, choice: ProposerChoice,
                 local_max_tokens: int, max_branches: int = 1) -> None:
        self.proposers, self.cost_model, self.choice = proposers, cost_model, choice
        self.local_max_tokens, self.max_branches = local_max_tokens, max(1, max_branches)
        self._round: SuffixRound | None = None

    async def propose(self, context_ids: list[int], num_tokens: int, room: int) -> Draft:
        self._note(None)
        cap = min(room, self.local_max_tokens)
        proposals = {LOCAL: self._local(context_ids, cap), GLOBAL: await self._shared(context_ids, cap)}
        proposals = {p: self.choice.trimmed(p, prop) for p, prop in proposals.items()}
        options = {p: (self.choice.expected_suffix(p, prop), len(prop.token_ids))
                   for p, prop in proposals.items() if prop.token_ids}
        if self.proposers.model is not None and num_tokens > 0 and self.proposers.model_round_allowed() \
                and self._model_holds_context(context_ids, num_tokens):
            options[MODEL] = (self.choice.expected_model(num_tokens), num_tokens)
        best = self.choice.choose(options) if options else None
        suffix_from = max((LOCAL, GLOBAL), key=lambda p: options.get(p, (0.0, 0))[0])     # LOCAL on a tie
        model_len, draft = 0, NO_DRAFT
        if best == MODEL:
            draft = NO_DRAFT if self._catching_up(context_ids, num_tokens) else \
                await self._from_model(context_ids, num_tokens)
            model_len = len(draft.token_ids)
            if not draft.token_ids and proposals[suffix_from].token_ids:
                best = suffix_from                       # the draft service failed or was overtaken this round
            elif self.max_branches > 1:
                draft = with_branches(draft, proposals[suffix_from])
        if best in (LOCAL, GLOBAL):
            suffix_from, suffix = best, proposals[best]
            draft = Draft(suffix.token_ids, None, SOURCES[best], None if suffix.is_chain else suffix.parents)
        for p in (LOCAL, GLOBAL):
            self.proposers.count(SOURCES[p], proposals[p].token_ids if best == p else [])
        with_suffix_nodes = best != MODEL or len(draft.token_ids) > model_len
        self.proposers.stats.tree_drafts += draft.parents is not None and with_suffix_nodes
        if best is not None and draft.token_ids:
            self._note(SuffixRound(best, suffix_from, proposals[suffix_from], draft, model_len))
        return draft

    def model_part(self, draft: Draft) -> Draft:
        """The draft service continues only its own chain (not the suffix branches beside it)."""
        done = self._round
        if done is not None and done.draft is draft and draft.parents is not None and done.model_len:
            dists = draft.dists[:done.model_len] if draft.dists is not None else None
            return Draft(draft.token_ids[:done.model_len], dists, draft.source)
        return draft

    def _model_holds_context(self, context_ids: list[int], num_tokens: int) -> bool:
        """Whether the draft service holds this request's context, so a model round waits for a block, not for a
        prefill. Under load the draft prefill is skipped where a model round could not pay (gateway/round_loop.py);
        when such a request later ran alone, its first Propose prefilled a ~4k-token document on the draft's one
        thread: 8.5 s in which its stream got nothing. So the model drafts only for requests whose draft prefill
        was sent, once it is done. After a failed call the whole context goes to the draft service again (another
        replica) in the background, and the model drafts once that is done (`ProposerSet.sync_in_background`); so does
        it after the service lost the session (NOT_FOUND: a restart, an expired lease) where the context is longer
        than a round may resend (`ModelDrafter.resend_in_round_max`)."""
        model = self.proposers.model
        if model is None or self.proposers.model_prefilling:
            return False
        if not model.link.bound and (model.link.num_failures > 0 or model.link.num_resends > 0):
            self.proposers.sync_in_background(context_ids, num_tokens)
        return model.link.bound

    def _catching_up(self, context_ids: list[int], num_tokens: int) -> bool:
        """A model round chosen after a run of suffix or undrafted rounds would bring the draft service every token
        verified since its last call, and wait while it computes them: a stream beside a long prompt's prefill
        (the draft on its own core) waited 3.3 s, 47x its median gap (up to ~1,000 of them). Past CATCH_UP_IN_ROUND
        tokens they go in the background instead (`ProposerSet.sync_in_background`) and this round drafts from the
        suffix proposals; the model is offered again once they are computed."""
        model = self.proposers.model
        if model is None or model.link.num_unsynced(context_ids) <= CATCH_UP_IN_ROUND:
            return False
        self.proposers.sync_in_background(context_ids, num_tokens)
        return True

    def _note(self, round: SuffixRound | None) -> None:
        self._round = round
        self.cost_model.drafted_suffix(round)

    async def _from_model(self, context_ids: list[int], num_tokens: int) -> Draft:
        started = time.perf_counter()
        draft = await self.proposers.from_model(context_ids, num_tokens)
        self.cost_model.observe_proposer_cost(MODEL, time.perf_counter() - started)
        return draft

    def _local(self, context_ids: list[int], cap: int) -> Proposal:
        if self.proposers.local_suffix is None:
            return EMPTY
        started = time.perf_counter()
        proposal = self.proposers.local_suffix.suggest(context_ids, cap)
        self.cost_model.observe_proposer_cost(LOCAL, time.perf_counter() - started)
        return proposal

    async def _shared(self, context_ids: list[int], cap: int) -> Proposal:
        if self.proposers.shared_suffix is None or cap <= 0:
            return EMPTY
        started = time.perf_counter()
        proposal = await self.proposers.shared_suffix.suggest(context_ids, cap)
        self.cost_model.observe_proposer_cost(GLOBAL, time.perf_counter() - started)
        return proposal


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

