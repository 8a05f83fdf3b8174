"""The draft cache against a real redis-server (and the in-process cache): hits, TTL, key secrecy, isolation,
encryption, garbage and outages. Every failure of the store must read as a miss, never as an error."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import pytest_asyncio
import redis

from kvstore.codec import ValueCodec, parse_aes_key
from kvstore.keys import KeyDeriver
from kvstore.memory import MemoryDraftCache
from kvstore.redis_cache import RedisDraftCache
from tests.redis_server import RedisServer

SECRET = b"test-secret"
AES_KEY = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
CONTEXT = [101, 7, 2024, 55, 9, 31337, 12, 8, 4242]
CONTINUATION = [77, 88, 99, 1234]


def deriver(secret: bytes = SECRET) -> KeyDeriver:
    return KeyDeriver(secret, "tiny-target", "tiny-target", (8, 4, 2))


@pytest.fixture(scope="module")
def server():
    srv = RedisServer().start()
    yield srv
    srv.kill()


@pytest_asyncio.fixture(loop_scope="session")
async def cache(server):
    server.cli("flushall")
    c = RedisDraftCache(server.url, deriver(), ValueCodec(), ttl_s=60, retry_after_s=0.2)
    yield c
    await c.close()


def store_keys(server: RedisServer) -> list[str]:
    return [k for k in server.cli("keys", "*").split() if k]


def test_keys_are_keyed_hashes_longest_first() -> None:
    keys = deriver().keys("tenant:a", CONTEXT)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert keys[0] == deriver().keys("tenant:a", [0, *CONTEXT[-8:]])[0]      # only the last 8 tokens count
    assert keys[2] == deriver().keys("tenant:a", [5, 5, *CONTEXT[-2:]])[-1]
    assert deriver().keys("tenant:a", [1]) == []                              # shorter than every suffix
    assert keys != deriver(b"other").keys("tenant:a", CONTEXT)
    assert keys != deriver().keys("tenant:b", CONTEXT)
    for key in keys:
        digest = key.removeprefix("specmesh:d:")
        assert len(digest) == 32 and all(ch in "0123456789abcdef" for ch in digest)


def test_codec_round_trip_and_refusals() -> None:
    plain, sealed = ValueCodec(), ValueCodec(parse_aes_key(AES_KEY))
    assert plain.decode("k", plain.encode("k", CONTINUATION)) == CONTINUATION
    blob = sealed.encode("k", CONTINUATION)
    assert sealed.decode("k", blob) == CONTINUATION
    assert blob == sealed.encode("k", CONTINUATION)                           # deterministic: counts add up
    assert b"".join(t.to_bytes(4, "little") for t in CONTINUATION) not in blob
    assert sealed.decode("other-key", blob) is None                           # bound to its key name
    assert ValueCodec(os.urandom(32)).decode("k", blob) is None               # wrong key: authentication fails
    assert sealed.decode("k", plain.encode("k", CONTINUATION)) is None        # no downgrade to plain values
    for garbage in (b"", b"\x01", b"\x01abc", b"\x07" + bytes(8), b"\x01" + bytes(4 * 17), "text", 12, None):
        assert plain.decode("k", garbage) is None and sealed.decode("k", garbage) is None
    with pytest.raises(ValueError):
        parse_aes_key("abcd")


async def test_memory_cache_hits_most_frequent_and_expires() -> None:
    now = [0.0]
    cache = MemoryDraftCache(deriver(), ttl_s=10, max_keys=100, clock=lambda: now[0])
    assert await cache.lookup("s", CONTEXT, 16) == []
    cache.record("s", CONTEXT, [1, 2, 3])
    cache.record("s", CONTEXT, CONTINUATION)
    cache.record("s", CONTEXT, CONTINUATION)
    assert await cache.lookup("s", CONTEXT, 16) == CONTINUATION
    assert await cache.lookup("s", CONTEXT, 2) == CONTINUATION[:2]
    assert await cache.lookup("other", CONTEXT, 16) == []
    assert await cache.lookup("s", [999, 998, *CONTEXT[-2:]], 16) == CONTINUATION   # the 2-token suffix matches
    now[0] = 10.5
    assert await cache.lookup("s", CONTEXT, 16) == []


async def test_memory_cache_is_bounded() -> None:
    cache = MemoryDraftCache(deriver(), ttl_s=100, max_keys=30)
    for i in range(100):
        cache.record("s", [i, i + 1, i + 2, i + 3], [i])
    assert len(cache._entries) <= 30
    assert await cache.lookup("s", [99, 100, 101, 102], 4) == [99]


async def test_redis_hit_miss_and_frequency(cache, server) -> None:
    assert await cache.lookup("tenant:a", CONTEXT, 16) == []
    cache.record("tenant:a", CONTEXT, [5, 6])
    for _ in range(3):
        cache.record("tenant:a", CONTEXT, CONTINUATION)
    await cache.flush()
    assert await cache.lookup("tenant:a", CONTEXT, 16) == CONTINUATION
    assert await cache.lookup("tenant:a", CONTEXT, 3) == CONTINUATION[:3]
    assert await cache.lookup("tenant:a", [1, 2, 3, *CONTEXT[-4:]], 16) == CONTINUATION   # 4-token suffix
    assert await cache.lookup("tenant:a", [1, 2, 3, 4], 16) == []
    assert cache.counters.hits == 3 and cache.counters.errors == 0


async def test_redis_bounds_continuations(cache, server) -> None:
    for i in range(10):
        cache.record("s", CONTEXT, [i] * 20)
    await cache.flush()
    for key in store_keys(server):
        assert int(server.cli("zcard", key)) <= 4
        members = redis.Redis(port=server.port).zrange(key, 0, -1)
        assert all(len(m) == 1 + 4 * 16 for m in members)                    # continuations capped at 16 tokens


async def test_redis_ttl_expiry(server) -> None:
    server.cli("flushall")
    cache = RedisDraftCache(server.url, deriver(), ValueCodec(), ttl_s=1)
    cache.record("s", CONTEXT, CONTINUATION)
    await cache.flush()
    assert 0 < int(server.cli("ttl", store_keys(server)[0])) <= 1
    assert await cache.lookup("s", CONTEXT, 16) == CONTINUATION
    await asyncio.sleep(1.3)
    assert await cache.lookup("s", CONTEXT, 16) == []
    assert store_keys(server) == []
    await cache.close()


async def test_redis_key_names_hide_tokens_and_text(cache, server) -> None:
    text_ids = list(b"password reset")                                        # "prompt text" as token ids
    cache.record("tenant:acme", [*CONTEXT, *text_ids], CONTINUATION)
    await cache.flush()
    names = store_keys(server)
    assert len(names) == 3
    dump = " ".join(names)
    for token in [*CONTEXT, *text_ids, *CONTINUATION]:
        assert f":{token}" not in dump and f",{token}" not in dump
    assert "acme" not in dump and "password" not in dump and "tiny" not in dump
    assert all(n.startswith("specmesh:d:") and len(n) == len("specmesh:d:") + 32 for n in names)


async def test_redis_tenant_isolation(cache) -> None:
    cache.record("tenant:a", CONTEXT, CONTINUATION)
    await cache.flush()
    assert await cache.lookup("tenant:b", CONTEXT, 16) == []
    assert await cache.lookup("tenant:a", CONTEXT, 16) == CONTINUATION


async def test_redis_encryption_round_trip_and_wrong_key(server) -> None:
    server.cli("flushall")
    sealed = RedisDraftCache(server.url, deriver(), ValueCodec(parse_aes_key(AES_KEY)), ttl_s=60)
    sealed.record("s", CONTEXT, CONTINUATION)
    await sealed.flush()
    assert await sealed.lookup("s", CONTEXT, 16) == CONTINUATION
    raw = redis.Redis(port=server.port).zrange(store_keys(server)[0], 0, -1)[0]
    assert b"".join(t.to_bytes(4, "little") for t in CONTINUATION) not in raw
    for codec in (ValueCodec(os.urandom(32)), ValueCodec()):                  # wrong key, or no key: a miss
        other = RedisDraftCache(server.url, deriver(), codec, ttl_s=60)
        assert await other.lookup("s", CONTEXT, 16) == []
        await other.close()
    await sealed.close()


async def test_redis_garbage_is_a_miss(cache, server) -> None:
    cache.record("s", CONTEXT, CONTINUATION)
    await cache.flush()
    long_key, mid_key, short_key = deriver().keys("s", CONTEXT)
    client = redis.Redis(port=server.port)
    client.zadd(long_key, {b"\xff\xfe garbage": 1000, b"": 999})              # undecodable members on top
    client.delete(mid_key)
    client.set(mid_key, b"not a sorted set")                                   # wrong type
    assert await cache.lookup("s", CONTEXT, 16) == CONTINUATION               # falls through to the next member
    client.delete(long_key)
    client.hset(long_key, "a", "b")
    assert await cache.lookup("s", CONTEXT, 16) == CONTINUATION               # short key still good
    client.delete(short_key)
    client.lpush(short_key, b"x")
    assert await cache.lookup("s", CONTEXT, 16) == []
    cache.record("s", CONTEXT, CONTINUATION)                                   # writes over garbage: no error
    await cache.flush()
    assert cache.counters.errors == 0


async def test_redis_down_is_a_miss_and_recovers(server) -> None:
    server.cli("flushall")
    cache = RedisDraftCache(server.url, deriver(), ValueCodec(), ttl_s=60, retry_after_s=0.2)
    cache.record("s", CONTEXT, CONTINUATION)
    await cache.flush()
    server.kill()
    try:
        start = time.monotonic()
        assert await cache.lookup("s", CONTEXT, 16) == []
        cache.record("s", CONTEXT, CONTINUATION)
        await cache.flush()
        assert await cache.lookup("s", CONTEXT, 16) == []
        assert time.monotonic() - start < 1.0
        assert cache.counters.errors >= 1
    finally:
        server.start()                                                         # same port, empty store
    await asyncio.sleep(0.3)
    for _ in range(3):                                                         # stale pooled connections fail once
        cache.record("s", CONTEXT, CONTINUATION)
        await cache.flush()
        if await cache.lookup("s", CONTEXT, 16) == CONTINUATION:
            break
        await asyncio.sleep(0.3)
    assert await cache.lookup("s", CONTEXT, 16) == CONTINUATION
    await cache.close()


async def test_redis_hung_is_a_fast_miss(cache, server) -> None:
    cache.record("s", CONTEXT, CONTINUATION)
    await cache.flush()
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert await cache.lookup("s", CONTEXT, 16) == []
        assert time.monotonic() - start < 0.3                                 # the read timeout, not a hang
        start = time.monotonic()
        assert await cache.lookup("s", CONTEXT, 16) == []                     # paused: no second wait
        assert time.monotonic() - start < 0.01
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    await asyncio.sleep(0.3)
    for _ in range(5):
        if await cache.lookup("s", CONTEXT, 16) == CONTINUATION:
            break
        await asyncio.sleep(0.3)
    assert await cache.lookup("s", CONTEXT, 16) == CONTINUATION


async def test_redis_cluster_client() -> None:
    node = RedisServer(cluster=True).start()
    try:
        cache = RedisDraftCache(node.url.removesuffix("/0"), deriver(), ValueCodec(parse_aes_key(AES_KEY)),
                                ttl_s=60, cluster=True)
        cache.record("s", CONTEXT, CONTINUATION)
        await cache.flush()
        assert await cache.lookup("s", CONTEXT, 16) == []          # learns the slot map in the background first
        for _ in range(40):
            await asyncio.sleep(0.05)
            if await cache.lookup("s", CONTEXT, 16):
                break
        assert await cache.lookup("s", CONTEXT, 16) == CONTINUATION
        assert len(store_keys(node)) == 3
        await cache.close()
    finally:
        node.kill()
