"""The n-gram proposer: the tokens that followed the latest earlier occurrence of the context's tail n-gram in the
request's own context (specmesh/spec/ngram.py). One-hot drafts, lossless at any temperature."""

from __future__ import annotations

from gateway.proposers.base import NO_DRAFT, Draft, Verified
from gateway.verify_cost import UNKNOWN_COST, VerifyCost
from protos.specmesh.v1 import common_pb2
from specmesh.spec.ngram import propose_ngram

NGRAM = common_pb2.DRAFT_SOURCE_NGRAM


class NgramProposer:
    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        ids = propose_ngram(context_ids, self.sizes, num_tokens)
        return Draft(ids, None, NGRAM) if ids else NO_DRAFT

    def observe(self, draft: Draft, num_accepted: int, verified: Verified,
                cost: VerifyCost = UNKNOWN_COST) -> None:
        pass                                      # the next propose reads the context it is given
