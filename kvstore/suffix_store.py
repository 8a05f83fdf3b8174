"""The shared layer of suffix drafting: a suffix trie of verified outputs, flattened into keyed nodes.

A literal suffix tree does not fit a key-value store, so each trie node below a context suffix is stored with its
subtree: per (tenant scope, the last L context tokens, for each L in a small set) one key whose members are the
verified continuations seen after that suffix (up to 16 tokens) and whose scores count how often each was seen.
The subtree's node counts are the sums over the continuations through them (`gateway.suffix_tree.
trie_from_continuations`), so one pipelined read (every L at once) returns the matched nodes with their subtrees.

Keys and values are exactly those of the draft cache (`kvstore/keys.py` HMAC-SHA256 names, `kvstore/codec.py`
AES-SIV varint values, keys from `kvstore/derive.py`), under their own prefix `sm:s:`, so the two never mix. Only
verified output tokens are written; Redis down, slow or holding garbage is a miss, never an error.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Protocol

from kvstore.base import MAX_CONTINUATIONS, CacheCounters
from kvstore.codec import ValueCodec, parse_aes_key
from kvstore.derive import key_names_key, values_key
from kvstore.factory import CacheSettings
from kvstore.keys import KeyDeriver
from kvstore.memory import MemoryDraftCache
from kvstore.redis_cache import RedisDraftCache

SUFFIX_PREFIX = "sm:s:"
MAX_COUNT = 1 << 30          # a score beyond this is garbage (counts grow by one per verified occurrence)

Continuations = list[tuple[list[int], int]]          # (continuation token ids, count)
SuffixHits = list[tuple[int, Continuations]]         # (suffix length L, its continuations), longest L first


class SuffixStore(Protocol):
    counters: CacheCounters

    async def lookup_counts(self, scope: str, context_ids: Sequence[int]) -> SuffixHits:
        """Every stored suffix of context_ids with its continuations and counts; [] on a miss or any failure."""
        ...

    def record(self, scope: str, context_ids: Sequence[int], verified_ids: Sequence[int]) -> None:
        """Counts verified_ids after each configured suffix of context_ids (behind the caller)."""
        ...

    async def close(self) -> None: ...


def _lens(keys: KeyDeriver, context_ids: Sequence[int]) -> list[int]:
    return [n for n in keys.suffix_lens if n <= len(context_ids)]          # the order of keys.keys()


class MemorySuffixStore(MemoryDraftCache):
    """In-process: one gateway's own store (the same LRU and TTL as the in-process draft cache)."""

    async def lookup_counts(self, scope: str, context_ids: Sequence[int]) -> SuffixHits:
        self.counters.lookups += 1
        now, hits = self.clock(), []
        for n, key in zip(_lens(self.keys, context_ids), self.keys.keys(scope, context_ids), strict=True):
            entry = self._entries.get(key)
            if entry is None or entry.expires_at <= now:
                continue
            self._entries.move_to_end(key)
            hits.append((n, [(list(c), count) for c, (count, _) in entry.counts.items()]))
        self.counters.hits += bool(hits)
        return hits


class RedisSuffixStore(RedisDraftCache):
    """Shared by every gateway on the same Redis (or Redis Cluster) and cache secret."""

    async def lookup_counts(self, scope: str, context_ids: Sequence[int]) -> SuffixHits:
        keys, replies = await self._read_suffix_keys(scope, context_ids, self._read_counts)
        hits = []
        for n, key, members in zip(_lens(self.keys, context_ids), keys, replies, strict=False):
            found = self._decode(key, members)
            if found:
                hits.append((n, found))
        self.counters.hits += bool(hits)
        return hits

    async def _read_counts(self, keys: list[str]) -> list[object]:
        pipe = self._reader.pipeline(transaction=False)
        for key in keys:
            pipe.zrevrange(key, 0, self.max_continuations - 1, withscores=True)
        return await pipe.execute(raise_on_error=False)   # a wrong-type key yields an error object: a miss

    def _decode(self, key: str, members: object) -> Continuations:
        """The decodable members with sane counts; anything else under the key is skipped."""
        out: Continuations = []
        for item in members if isinstance(members, list) else ():
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                continue
            member, score = item
            tokens = self.codec.decode(key, member)
            if tokens and isinstance(score, (int, float)) and math.isfinite(score) and 1 <= score <= MAX_COUNT:
                out.append((tokens, int(score)))
        return out


def open_suffix_store(settings: CacheSettings, model: str, tokenizer: str) -> MemorySuffixStore | RedisSuffixStore:
    """Like kvstore.open_cache: in-process without a Redis URL; keys and values from the one cache secret."""
    secret = settings.secret.encode() or os.urandom(32)
    keys = KeyDeriver(key_names_key(secret), model, tokenizer, settings.suffix_lens, prefix=SUFFIX_PREFIX)
    if not settings.redis_url:
        return MemorySuffixStore(keys, settings.ttl_s, settings.max_keys, MAX_CONTINUATIONS)
    explicit = parse_aes_key(settings.encryption_key) if settings.encryption_key else None
    return RedisSuffixStore(settings.redis_url, keys, ValueCodec(values_key(secret, explicit)), settings.ttl_s,
                            cluster=settings.cluster, read_timeout_s=settings.read_timeout_s)
