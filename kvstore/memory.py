"""The embedded draft cache: an in-process LRU of suffix keys with TTL, same semantics as the Redis one."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.base import MAX_CONTINUATION_TOKENS, MAX_CONTINUATIONS, CacheCounters
from kvstore.keys import KeyDeriver


@dataclass
class _Entry:
    expires_at: float
    counts: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)  # continuation -> (count, seq)


class MemoryDraftCache:
    def __init__(self, keys: KeyDeriver, ttl_s: float, max_keys: int = 100_000,
                 max_continuations: int = MAX_CONTINUATIONS, clock: Callable[[], float] = time.monotonic) -> None:
        self.keys = keys
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self.max_continuations = max_continuations
        self.clock = clock
        self.counters = CacheCounters()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._seq = 0

    async def lookup(self, scope: str, context_ids: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        self.counters.lookups += 1
        now = self.clock()
        for key in self.keys.keys(scope, context_ids):
            entry = self._entries.get(key)
            if entry is None:
                continue
            if entry.expires_at <= now:
                del self._entries[key]
                continue
            self._entries.move_to_end(key)
            best = max(entry.counts.items(), key=lambda item: item[1])[0]
            self.counters.hits += 1
            return list(best[:max_tokens])
        return []

    def record(self, scope: str, context_ids: Sequence[int], verified_ids: Sequence[int]) -> None:
        continuation = tuple(verified_ids[:MAX_CONTINUATION_TOKENS])
        if not continuation:
            return
        self.counters.records += 1
        now = self.clock()
        for key in self.keys.keys(scope, context_ids):
            entry = self._entries.pop(key, None)
            if entry is None or entry.expires_at <= now:
                entry = _Entry(now)
            self._add(entry, continuation)
            entry.expires_at = now + self.ttl_s
            self._entries[key] = entry
        while len(self._entries) > self.max_keys:
            self._entries.popitem(last=False)

    def _add(self, entry: _Entry, continuation: tuple[int, ...]) -> None:
        self._seq += 1
        count = entry.counts.get(continuation, (0, 0))[0]
        entry.counts[continuation] = (count + 1, self._seq)
        if len(entry.counts) > self.max_continuations:
            del entry.counts[min(entry.counts.items(), key=lambda item: item[1])[0]]

    async def close(self) -> None:
        self._entries.clear()
