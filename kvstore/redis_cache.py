"""The shared draft cache in Redis (a plain server or Redis Cluster).

Each suffix key is a sorted set: member = encoded continuation, score = how often it was verified after that
suffix; at most `max_continuations` members (the least frequent are trimmed) and a TTL refreshed on every write.
Reads are one pipelined round trip under a short timeout; writes are queued and pipelined by a background task,
never awaited by a request. Any failure -- Redis down, slow, or holding garbage -- is a miss: the request goes on
without the cache, a warning is logged at most once per interval, and Redis is tried again after a short pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.base import MAX_CONTINUATION_TOKENS, MAX_CONTINUATIONS, CacheCounters, LogLimiter
from kvstore.codec import ValueCodec
from kvstore.keys import KeyDeriver

log = logging.getLogger(__name__)

READ_TOP = 2                 # members read per key: a garbage top member falls through to the next
WRITE_BATCH = 128            # records per pipelined write


def make_client(url: str, cluster: bool, timeout_s: float, retries: int, max_connections: int) -> Redis | RedisCluster:
    retry = Retry(NoBackoff(), retries)
    if cluster:
        return RedisCluster.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry,
                                     max_connections=max_connections)
    return Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry,
                          max_connections=max_connections)


class RedisDraftCache:
    def __init__(self, url: str, keys: KeyDeriver, codec: ValueCodec, ttl_s: float, cluster: bool = False,
                 read_timeout_s: float = 0.05, write_timeout_s: float = 1.0, retry_after_s: float = 1.0,
                 max_pending: int = 4096, max_continuations: int = MAX_CONTINUATIONS,
                 max_connections: int = 32) -> None:
        self.keys = keys
        self.codec = codec
        self.ttl_s = max(1, int(ttl_s))
        self.read_timeout_s = read_timeout_s
        self.retry_after_s = retry_after_s
        self.max_pending = max_pending
        self.max_continuations = max_continuations
        self.counters = CacheCounters()
        self._reader = make_client(url, cluster, read_timeout_s, 0, max_connections)
        self._writer = make_client(url, cluster, write_timeout_s, 1, max(2, max_connections // 4))
        self._pending: deque[tuple[str, tuple[int, ...], tuple[int, ...]]] = deque()
        self._write_task: asyncio.Task[None] | None = None
        self._cluster = cluster
        self._reader_ready = not cluster           # a cluster client first learns the slot map: not on a request
        self._connect_task: asyncio.Task[None] | None = None
        self._write_timeout_s = write_timeout_s
        self._down_until = 0.0
        self._warn = LogLimiter(log)

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        self.counters.errors += 1
        self._reader_ready = not self._cluster
        self._down_until = time.monotonic() + self.retry_after_s
        self._warn.warning("draft cache %s failed (%s: %s); going on without it", what, type(exc).__name__, exc)

    async def lookup(self, scope: str, context_ids: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        keys, replies = await self._read_suffix_keys(scope, context_ids, self._read)
        for key, members in zip(keys, replies, strict=False):
            for member in members if isinstance(members, list) else ():
                tokens = self.codec.decode(key, member)
                if tokens:
                    self.counters.hits += 1
                    return tokens[:max_tokens]
        return []

    async def _read_suffix_keys(self, scope: str, context_ids: Sequence[int],
                                read: Callable[[list[str]], Awaitable[list[Any]]]) -> tuple[list[str], list[Any]]:
        """(the context's suffix keys, Redis's reply per key), or two empty lists: Redis paused after a failure, the
        reader still connecting, or a read that failed or was slow (any failure is a miss, never a client error)."""
        if not self._available():
            return [], []
        if not self._reader_ready:
            self._connect()
            return [], []
        keys = self.keys.keys(scope, context_ids)
        if not keys:
            return [], []
        self.counters.lookups += 1
        try:
            return keys, await asyncio.wait_for(read(keys), 2 * self.read_timeout_s)
        except Exception as exc:
            self._failed("read", exc)
            return [], []

    def _connect(self) -> None:
        """Initializes the cluster reader (slot map, command table) in the background."""
        if self._connect_task is not None:
            return

        async def run() -> None:
            try:
                await asyncio.wait_for(self._reader.initialize(), self._write_timeout_s)
                self._reader_ready = True
            except Exception as exc:  # Redis unreachable: retried after the pause
                self._failed("connect", exc)
            finally:
                self._connect_task = None

        self._connect_task = asyncio.get_running_loop().create_task(run())

    async def _read(self, keys: list[str]) -> list[object]:
        pipe = self._reader.pipeline(transaction=False)
        for key in keys:
            pipe.zrevrange(key, 0, READ_TOP - 1)
        return await pipe.execute(raise_on_error=False)   # a wrong-type key yields an error object: a miss

    def record(self, scope: str, context_ids: Sequence[int], verified_ids: Sequence[int]) -> None:
        continuation = tuple(verified_ids[:MAX_CONTINUATION_TOKENS])
        if not continuation:
            return
        if len(self._pending) >= self.max_pending or not self._available():
            self.counters.dropped += 1
            return
        self.counters.records += 1
        self._pending.append((scope, tuple(context_ids[-self.keys.max_len:]), continuation))
        if self._write_task is None:
            self._write_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch = [self._pending.popleft() for _ in range(min(WRITE_BATCH, len(self._pending)))]
                try:
                    await self._write(batch)
                except Exception as exc:  # a failed write only loses cache entries
                    self._failed("write", exc)
                    self.counters.dropped += len(batch) + len(self._pending)
                    self._pending.clear()
        finally:
            self._write_task = None

    async def _write(self, batch: list[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> None:
        pipe = self._writer.pipeline(transaction=False)
        for scope, context, continuation in batch:
            for key in self.keys.keys(scope, context):
                pipe.zincrby(key, 1, self.codec.encode(key, continuation))
                pipe.zremrangebyrank(key, 0, -self.max_continuations - 1)
                pipe.expire(key, self.ttl_s)
        await pipe.execute(raise_on_error=False)          # per-key errors (garbage under a key) are skipped

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Waits (up to timeout_s) until queued writes reached Redis or were dropped."""
        task = self._write_task
        if task is not None:
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(task), timeout_s)

    async def close(self) -> None:
        await self.flush()
        if self._write_task is not None:
            self._write_task.cancel()
        for client in (self._reader, self._writer):
            with contextlib.suppress(Exception):
                await client.aclose()
