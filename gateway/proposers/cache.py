"""The draft cache proposer: continuations that followed the same recent context in earlier requests' verified
output (kvstore/), and the writer that records this request's verified output behind it.

Cache drafts are one-hot proposals (dists=None), so rejection sampling keeps them lossless at any temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gateway.proposers.base import NO_DRAFT, Draft, Verified, VerifiedTokens
from gateway.round_spans import cache_lookup_span
from gateway.verify_cost import UNKNOWN_COST, VerifyCost
from kvstore.base import MAX_CONTINUATION_TOKENS, DraftCache
from protos.specmesh.v1 import common_pb2

CACHE = common_pb2.DRAFT_SOURCE_CACHE


class ContinuationSink(Protocol):
    """Where verified continuations are written: a `DraftCache` or a `SuffixStore`."""

    def record(self, scope: str, context_ids: Sequence[int], verified_ids: Sequence[int]) -> None: ...


def valid_ids(ids: Sequence[object], vocab_size: int) -> list[int]:
    """The leading ids that are real token ids (a cache may hold anything)."""
    out: list[int] = []
    for t in ids:
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            break
        out.append(t)
    return out


class ContinuationWriter:
    """Writes the verified continuation after each output position to the sink, keyed by the `context_tail`
    tokens before it, once `MAX_CONTINUATION_TOKENS` follow it (the last positions at close)."""

    def __init__(self, sink: ContinuationSink, scope: str, context_tail: int) -> None:
        self.sink, self.scope, self.context_tail = sink, scope, context_tail
        self._verified: Verified = VerifiedTokens((), ())   # the owner's tokens as of the last observe
        self._recorded = 0                                   # output positions already written

    def observe(self, verified: Verified) -> None:
        self._verified = verified
        self._record(len(verified.output_ids) - MAX_CONTINUATION_TOKENS)

    def close(self) -> None:
        self._record(len(self._verified.output_ids))         # the last positions, with shorter continuations

    def _record(self, upto: int) -> None:
        out, tail, prompt = self._verified.output_ids, self.context_tail, self._verified.prompt_ids
        for p in range(self._recorded, upto):
            context = out[p - tail:p] if p >= tail else [*prompt[max(0, len(prompt) - tail + p):], *out[:p]]
            self.sink.record(self.scope, list(context), list(out[p:p + MAX_CONTINUATION_TOKENS]))
        self._recorded = max(self._recorded, upto)


class CacheProposer:
    """Proposes up to `num_tokens` cached tokens (the policy sizes it: its cap, priced under load)."""

    def __init__(self, cache: DraftCache, scope: str, vocab_size: int, context_tail: int) -> None:
        self.cache, self.scope, self.vocab_size = cache, scope, vocab_size
        self.writer = ContinuationWriter(cache, scope, context_tail)

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        if num_tokens <= 0:
            return NO_DRAFT
        with cache_lookup_span() as span:
            ids = valid_ids(await self.cache.lookup(self.scope, context_ids, num_tokens), self.vocab_size)
            span.set_attribute("specmesh.cache.draft_tokens", len(ids))
        return Draft(ids, None, CACHE) if ids else NO_DRAFT

    def observe(self, draft: Draft, num_accepted: int, verified: Verified,
                cost: VerifyCost = UNKNOWN_COST) -> None:
        self.writer.observe(verified)

    def close(self) -> None:
        self.writer.close()
