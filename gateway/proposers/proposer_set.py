"""A request's proposers, and the gateway-wide counters their rounds bump (gateway/tier_stats.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.proposers.base import NO_DRAFT, Draft, ModelProposer
from gateway.proposers.cache import CacheProposer
from gateway.proposers.ngram import NgramProposer
from gateway.proposers.suffix import LocalSuffixProposer, SharedSuffixProposer
from gateway.tier_stats import DraftingStats
from protos.specmesh.v1 import common_pb2


@dataclass
class ProposerSet:
    """Each proposer a request may draft with (None: not configured for it). The tiers use cache, ngram and model;
    suffix drafting uses local_suffix, shared_suffix and model."""
    stats: DraftingStats
    model: ModelProposer | None = None
    cache: CacheProposer | None = None
    ngram: NgramProposer | None = None
    local_suffix: LocalSuffixProposer | None = None
    shared_suffix: SharedSuffixProposer | None = None
    model_prefilling: bool = False               # the draft service is prefilling the request's context now
    sync_prefill: bool = False                   # the prefill returns once computed (ModelProposer.sync)
    _bytes_counted: tuple[int, int] = (0, 0)     # the model's bytes sent / received already counted
    _sync: asyncio.Future[None] | None = field(default=None, repr=False)     # see sync_in_background

    def count(self, source: int, ids: list[int]) -> Draft | None:
        """A hit (ids) or a miss for the proposer's tier; the draft when it has one."""
        counters = self.stats.tier(source)
        if counters is not None:
            if ids:
                counters.hits += 1
            else:
                counters.misses += 1
        return Draft(ids, None, source) if ids else None

    def model_round_allowed(self) -> bool:
        """False while the draft link backs off after a failure. Each such round uses one backoff round up, as
        `ModelDrafter.propose` does: a round that never asked the model would leave it locked out for good."""
        return self.model is not None and self.model.link.round_allowed()

    async def prefill_model(self, context_ids: list[int], num_tokens: int) -> None:
        """The draft service computes the context's KV and drafts ahead. With `sync_prefill` (suffix drafting) the
        call returns once the context is computed and no model round is offered meanwhile (`model_prefilling`), so
        no round waits for a long context's draft prefill; the tiers' prefill returns as soon as the service holds
        the context (beside the verifier's prefill: the first token does not wait for the draft's compute)."""
        if self.model is not None:
            await self._prefilling(self.model.sync if self.sync_prefill else self.model.prefill, context_ids,
                                   num_tokens)

    async def _prefilling(self, call: Callable[[list[int], int], Awaitable[None]], context_ids: list[int],
                          num_tokens: int) -> None:
        self.model_prefilling = True
        try:
            await call(context_ids, num_tokens)
        finally:
            self.model_prefilling = False
        self.count_bytes()

    def sync_in_background(self, context_ids: list[int], num_tokens: int) -> None:
        """What the draft service lacks of the context, sent outside any round like the prompt's prefill: the whole
        context after a failed call (the replica it reroutes to), or a long catch-up. Inside a Propose a ~4k-token
        document held its stream for the draft's whole prefill, a long catch-up for 3.3 s. The model is
        offered again once it is computed (`model_prefilling` until then)."""
        if self.model is None or self.model_prefilling:
            return
        self.model_prefilling = True                 # from now: the rounds until the task runs see it too
        self._sync = asyncio.ensure_future(self._prefilling(functools.partial(self.model.sync, backs_off=True),
                                                            context_ids, num_tokens))

    async def cancel_sync(self) -> None:
        task, self._sync = self._sync, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        self.model_prefilling = False

    async def from_model(self, context_ids: list[int], num_tokens: int) -> Draft:
        if self.model is None or num_tokens <= 0:
            return NO_DRAFT
        hits = self.model.num_prefetch_hits
        draft = await self.model.propose(context_ids, num_tokens)
        self.stats.prefetch_hits += self.model.num_prefetch_hits - hits
        self.count_bytes()
        self.count(common_pb2.DRAFT_SOURCE_MODEL, draft.token_ids)
        return draft

    def count_bytes(self) -> None:
        """Adds the draft link's traffic since the last count (prefetch answers arrive in the background)."""
        if self.model is None:
            return
        self.stats.draft_bytes_sent += self.model.bytes_sent - self._bytes_counted[0]
        self.stats.draft_bytes_received += self.model.bytes_received - self._bytes_counted[1]
        self._bytes_counted = (self.model.bytes_sent, self.model.bytes_received)
