"""The drafting tiers' gateway-wide part: settings, the draft cache (or, with `suffix_drafting`, the shared suffix
store), the tenant scopes and the counters. A request's proposers and the policy composing them are built from it
by gateway/proposers/compose.py: the draft cache, then n-gram lookup, then the draft service
(gateway/proposers/tier_order.py), or suffix drafting's choice (gateway/proposers/suffix_rule.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.tier_stats import DraftingStats
from kvstore import CacheSettings, open_cache
from kvstore.base import DraftCache
from kvstore.factory import parse_lens
from kvstore.suffix_store import SuffixStore, open_suffix_store
from specmesh.config import GatewayConfig
from specmesh.rpc.security import TENANT_HEADER, ApiKeys, Denied, Metadata, load_api_keys, tenant_of

__all__ = ["TENANT_HEADER", "DraftTiers", "TierSettings", "build_tiers", "tenant_from_metadata"]


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
    draft_host_share: float = 0.0           # the verifier's compute a running draft model takes (suffix_choice.py)


def build_tiers(config: GatewayConfig, model: str, tokenizer: str, vocab_size: int) -> DraftTiers:
    if config.cache_scope not in ("tenant", "shared"):
        raise ValueError(f"cache_scope must be 'tenant' or 'shared', got {config.cache_scope!r}")
    if not 0.0 <= config.draft_host_share <= 1.0:
        raise ValueError(f"draft_host_share must be within [0, 1], got {config.draft_host_share}")
    suffix_lens = parse_lens(config.cache_suffix_lens)
    settings = TierSettings(vocab_size, config.cache_scope == "shared", config.enable_ngram,
                            parse_lens(config.ngram_sizes), config.local_draft_tokens, max(suffix_lens),
                            config.suffix_drafting, 1 + max(0, config.draft_tree_width), config.draft_host_share)
    if not config.enable_cache:
        return DraftTiers(settings, None, load_api_keys(config))
    cache_settings = CacheSettings(config.redis_url, config.redis_cluster, config.cache_secret,
                                   config.cache_encryption_key, config.cache_ttl_s, suffix_lens,
                                   read_timeout_s=config.cache_read_timeout_s)
    if config.suffix_drafting:
        return DraftTiers(settings, None, load_api_keys(config), open_suffix_store(cache_settings, model, tokenizer))
    return DraftTiers(settings, open_cache(cache_settings, model, tokenizer), load_api_keys(config))


def tenant_from_metadata(metadata: Metadata, keys: ApiKeys | None = None) -> str | None:
    """The request's tenant (specmesh.rpc.security.resolve_tenant); None when the call would be refused. The API-key
    interceptor refuses such calls before they get here, with the same keys."""
    tenant = tenant_of(keys or {}, metadata)
    return None if isinstance(tenant, Denied) else tenant


class DraftTiers:
    """Gateway-wide: the cache or suffix store, the settings and the counters (gateway/proposers/compose.py builds
    each request's proposers from them)."""

    def __init__(self, settings: TierSettings, cache: DraftCache | None, api_keys: ApiKeys | None = None,
                 store: SuffixStore | None = None) -> None:
        self.settings = settings
        self.cache = cache                         # the draft cache tier (tiers)
        self.store = store                         # the shared suffix store (suffix drafting)
        self.api_keys = api_keys or {}             # key -> tenant: an authenticated request's scope is its key's
        self.stats = DraftingStats()

    def tenant(self, metadata: Metadata) -> str | None:
        return tenant_from_metadata(metadata, self.api_keys)

    def scope(self, tenant: str | None) -> str | None:
        """The cache scope of a request of `tenant`; None: no cache for it (tenant None, unresolved, is unreachable
        behind the API-key interceptor; kept safe anyway)."""
        if self.settings.shared_scope:
            return "shared"
        return f"tenant:{tenant}" if tenant is not None else None

    def snapshot(self) -> dict[str, int]:
        """Tier counters, draft-link bytes and the cache's own counters (`cache_store_*`), as plain ints."""
        out = self.stats.snapshot()
        for cache in (self.cache, self.store):
            if cache is not None:
                out.update({f"cache_store_{k}": v for k, v in vars(cache.counters).items()})
        return out

    async def close(self) -> None:
        for cache in (self.cache, self.store):
            if cache is not None:
                await cache.close()
