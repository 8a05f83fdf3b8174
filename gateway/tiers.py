"""Drafting tiers: the draft cache, then n-gram lookup in the request's own context, then the draft service.
With `suffix_drafting` on, one suffix-tree proposer replaces the first two (gateway/suffix_drafter.py).

The first tier with a proposal drafts the round. Cache and n-gram drafts are one-hot proposals (dists=None), so
the verifier's rejection sampling keeps every tier lossless at any temperature; a wrong draft only costs a few
verified positions. A round that skips the draft service leaves its session behind; the next Propose sends every
token since the last sync, so it catches up. Verified output tokens are written to the cache behind the request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.drafters import NO_DRAFT, Draft, ModelDrafter, Verified, VerifiedTokens
from gateway.round_spans import cache_lookup_span
from gateway.tier_stats import DraftingStats
from gateway.verify_cost import UNKNOWN_COST, VerifyCost
from kvstore import CacheSettings, open_cache
from kvstore.base import MAX_CONTINUATION_TOKENS, DraftCache
from kvstore.factory import parse_lens
from kvstore.suffix_store import open_suffix_store
from protos.specmesh.v1 import common_pb2
from specmesh.config import GatewayConfig
from specmesh.rpc.security import TENANT_HEADER, ApiKeys, Denied, Metadata, load_api_keys, tenant_of
from specmesh.spec.ngram import propose_ngram

__all__ = ["TENANT_HEADER", "DraftTiers", "TierSettings", "build_tiers", "tenant_from_metadata"]
CACHE = common_pb2.DRAFT_SOURCE_CACHE
NGRAM = common_pb2.DRAFT_SOURCE_NGRAM


@dataclass(frozen=True)
class TierSettings:
    vocab_size: int
    shared_scope: bool = False              # one cache scope for all tenants (opt-in)
    enable_ngram: bool = True
    ngram_sizes: tuple[int, ...] = (4, 3)
    local_max_tokens: int = 16              # longest cache / n-gram draft per round
    context_tail: int = 8                   # context tokens the cache keys look at
    suffix_drafting: bool = False           # the suffix-tree proposer replaces the cache and n-gram tiers
    max_branches: int = 1                   # suffix drafts: children per tree node (1 = chains)


def build_tiers(config: GatewayConfig, model: str, tokenizer: str, vocab_size: int) -> DraftTiers:
    if config.cache_scope not in ("tenant", "shared"):
        raise ValueError(f"cache_scope must be 'tenant' or 'shared', got {config.cache_scope!r}")
    suffix_lens = parse_lens(config.cache_suffix_lens)
    settings = TierSettings(vocab_size, config.cache_scope == "shared", config.enable_ngram,
                            parse_lens(config.ngram_sizes), config.local_draft_tokens, max(suffix_lens),
                            config.suffix_drafting, 1 + max(0, getattr(config, "draft_tree_width", 0)))
    cache = None
    if config.enable_cache:
        cache_settings = CacheSettings(config.redis_url, config.redis_cluster, config.cache_secret,
                                       config.cache_encryption_key, config.cache_ttl_s, suffix_lens,
                                       read_timeout_s=config.cache_read_timeout_s)
        opener = open_suffix_store if config.suffix_drafting else open_cache
        cache = opener(cache_settings, model, tokenizer)
    return DraftTiers(settings, cache, load_api_keys(config))


def tenant_from_metadata(metadata: Metadata, keys: ApiKeys | None = None) -> str | None:
    """The request's tenant (specmesh.security.resolve_tenant); None when the call would be refused. The API-key
    interceptor refuses such calls before they get here, with the same keys."""
    tenant = tenant_of(keys or {}, metadata)
    return None if isinstance(tenant, Denied) else tenant


class DraftTiers:
    """Gateway-wide: the cache, the settings and the counters; makes one `TieredDrafter` per generation."""

    def __init__(self, settings: TierSettings, cache: DraftCache | None, api_keys: ApiKeys | None = None) -> None:
        self.settings = settings
        self.cache = cache
        self.api_keys = api_keys or {}             # key -> tenant: an authenticated request's scope is its key's
        self.stats = DraftingStats()

    def tenant(self, metadata: Metadata) -> str | None:
        return tenant_from_metadata(metadata, self.api_keys)

    def drafter(self, model: ModelDrafter | None, tenant: str | None) -> TieredDrafter:
        """One request's drafter. tenant None (unresolved: no cache) is unreachable behind the API-key interceptor;
        kept safe anyway."""
        scope = "shared" if self.settings.shared_scope else f"tenant:{tenant}"
        cache = self.cache if tenant is not None or self.settings.shared_scope else None
        if self.settings.suffix_drafting:
            from gateway.suffix_drafter import SuffixDrafter  # it builds on TieredDrafter, below
            return SuffixDrafter(self, scope, model, cache, self.settings.max_branches)
        return TieredDrafter(self, scope, model, cache)

    def snapshot(self) -> dict[str, int]:
        """Tier counters, draft-link bytes and the cache's own counters (`cache_store_*`), as plain ints."""
        out = self.stats.snapshot()
        if self.cache is not None:
            out.update({f"cache_store_{k}": v for k, v in vars(self.cache.counters).items()})
        return out

    async def close(self) -> None:
        if self.cache is not None:
            await self.cache.close()


class TieredDrafter:
    """The request's budget and tokens are not kept here: each call brings them (`room`, `Verified`)."""

    def __init__(self, tiers: DraftTiers, scope: str, model: ModelDrafter | None, cache: DraftCache | None) -> None:
        self.tiers = tiers
        self.cache = cache
        self.settings = tiers.settings
        self.scope = scope
        self.model = model
        self._verified: Verified = VerifiedTokens((), ())   # the owner's tokens as of the last observe (for close)
        self._recorded = 0                           # output positions already written to the cache
        self._bytes_counted = (0, 0)                 # the model drafter's bytes sent / received already counted
        self._caps = {CACHE: self.settings.local_max_tokens, NGRAM: self.settings.local_max_tokens}
        # Prices a local draft's length under load (DraftLengthController.local_draft_cap); None: the tier's cap.
        self.local_cap: Callable[[int], int] | None = None

    async def prefill(self, prompt_ids: list[int], num_tokens: int) -> None:
        if self.model is not None:
            await self.model.prefill(prompt_ids, num_tokens)
            self._count_bytes()

    def prefetch(self, context_ids: list[int], draft: Draft, num_tokens: int) -> None:
        """Only a model-drafted round continues the draft service's own block (see ModelDrafter.prefetch)."""
        if self.model is not None and draft.source == common_pb2.DRAFT_SOURCE_MODEL:
            self.model.prefetch(context_ids, draft, num_tokens)
            self.tiers.stats.prefetch_sent += self.model.prefetching

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        """num_tokens is the draft service's length; local drafts are free, so they fill the room left."""
        room = num_tokens if room is None else room
        if room <= 0:
            return NO_DRAFT
        if self.cache is not None and (n := self._local_room(room, CACHE)) > 0:
            with cache_lookup_span() as span:
                ids = self._valid(await self.cache.lookup(self.scope, context_ids, n))
                span.set_attribute("specmesh.cache.draft_tokens", len(ids))
            if draft := self._count(CACHE, ids):
                return draft
        if self.settings.enable_ngram and (n := self._local_room(room, NGRAM)) > 0:
            ids = propose_ngram(context_ids, self.settings.ngram_sizes, n)
            if draft := self._count(NGRAM, ids):
                return draft
        return await self._from_model(context_ids, num_tokens)

    def _local_room(self, room: int, tier: int) -> int:
        n = min(room, self._caps[tier])
        return self.local_cap(n) if self.local_cap is not None else n

    def _valid(self, ids: Sequence[object]) -> list[int]:
        """The leading ids that are real token ids (a cache may hold anything)."""
        out: list[int] = []
        for t in ids:
            if not isinstance(t, int) or not 0 <= t < self.settings.vocab_size:
                break
            out.append(t)
        return out

    def _count(self, source: int, ids: list[int]) -> Draft | None:
        counters = self.tiers.stats.tier(source)
        if counters is not None:
            if ids:
                counters.hits += 1
            else:
                counters.misses += 1
        return Draft(ids, None, source) if ids else None

    async def _from_model(self, context_ids: list[int], num_tokens: int) -> Draft:
        if self.model is None or num_tokens <= 0:
            return NO_DRAFT
        hits = self.model.num_prefetch_hits
        draft = await self.model.propose(context_ids, num_tokens)
        self.tiers.stats.prefetch_hits += self.model.num_prefetch_hits - hits
        self._count_bytes()
        self._count(common_pb2.DRAFT_SOURCE_MODEL, draft.token_ids)
        return draft

    def _count_bytes(self) -> None:
        """Adds the draft link's traffic since the last count (prefetch answers arrive in the background)."""
        if self.model is None:
            return
        stats = self.tiers.stats
        stats.draft_bytes_sent += self.model.bytes_sent - self._bytes_counted[0]
        stats.draft_bytes_received += self.model.bytes_received - self._bytes_counted[1]
        self._bytes_counted = (self.model.bytes_sent, self.model.bytes_received)

    def observe(self, draft: Draft, num_accepted: int, verified: Verified,
                cost: VerifyCost = UNKNOWN_COST) -> None:
        counters = self.tiers.stats.tier(draft.source)
        if counters is not None:
            counters.drafted += len(draft.token_ids)
            counters.accepted += num_accepted
        if draft.source in self._caps:               # grow a tier's draft length while it is right, cut it when not
            full = num_accepted == len(draft.token_ids)
            cap = self._caps[draft.source] * 2 if full else num_accepted + 1
            self._caps[draft.source] = max(1, min(cap, self.settings.local_max_tokens))
        self._verified = verified
        self._record(len(verified.output_ids) - MAX_CONTINUATION_TOKENS)

    def _record(self, upto: int) -> None:
        """Writes the verified continuation after each output position < upto to the cache."""
        cache, out = self.cache, self._verified.output_ids
        if cache is None:
            return
        tail, prompt = self.settings.context_tail, self._verified.prompt_ids
        for p in range(self._recorded, upto):
            context = out[p - tail:p] if p >= tail else [*prompt[max(0, len(prompt) - tail + p):], *out[:p]]
            cache.record(self.scope, list(context), list(out[p:p + MAX_CONTINUATION_TOKENS]))
        self._recorded = max(self._recorded, upto)

    async def close(self) -> None:
        self._record(len(self._verified.output_ids))   # the last positions, with shorter continuations
        if self.model is not None:
            await self.model.close()
            self._count_bytes()
