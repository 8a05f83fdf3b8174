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

from kvstore.codec import ValueCodec, pack_varints, parse_aes_key, unpack_varints
from kvstore.derive import values_key
from kvstore.factory import CacheSettings, open_cache
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


def codec(secret: bytes = SECRET) -> ValueCodec:
    return ValueCodec(values_key(secret))


@pytest.fixture(scope="module")
def server():
    srv = RedisServer().start()
    yield srv
    srv.kill()


@pytest_asyncio.fixture(loop_scope="session")
async def cache(server):
    server.cli("flushall")
    c = RedisDraftCache(server.url, deriver(), codec(), ttl_s=60, retry_after_s=0.2)
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
        digest = key.removeprefix("sm:d:")
        assert len(key) == 27 and len(digest) == 22 and all(ch.isalnum() or ch in "-_" for ch in digest)


def test_varints_round_trip_and_refusals() -> None:
    ids = [0, 1, 127, 128, 16383, 16384, 151_935, 2**21 - 1, 2**32 - 1]
    assert unpack_varints(pack_varints(ids), len(ids)) == ids
    assert len(pack_varints([127, 16383, 2**21 - 1])) == 1 + 2 + 3
    assert unpack_varints(pack_varints([5] * 17)) is None                     # more than 16 tokens
    for bad in (b"", b"\x80", b"\x01\xff", b"\xff\xff\xff\xff\x7f", b"\xff" * 6):
        assert unpack_varints(bad) is None                                    # empty, truncated, over 32 bits
    with pytest.raises(ValueError):
        pack_varints([-1])


def test_codec_round_trip_and_refusals() -> None:
    sealed = codec()
    blob = sealed.encode("k", CONTINUATION)
    assert sealed.decode("k", blob) == CONTINUATION
    assert blob == sealed.encode("k", CONTINUATION)                           # deterministic: counts add up
    assert pack_varints(CONTINUATION) not in blob
    assert len(blob) == 16 + len(pack_varints(CONTINUATION))
    assert len(sealed.encode("k", [151_935] * 16)) <= 64                     # fits Redis' compact sorted set
    assert sealed.decode("other-key", blob) is None                           # bound to its key name
    assert codec(b"other").decode("k", blob) is None                          # wrong key: authentication fails
    assert sealed.decode("k", pack_varints(CONTINUATION)) is None             # no plain values
    for garbage in (b"", b"\x01", b"\x01abc", bytes(17), bytes(80), "text", 12, None):
        assert sealed.decode("k", garbage) is None
    with pytest.raises(ValueError):
        parse_aes_key("abcd")
    with pytest.raises(ValueError):
        ValueCodec(bytes(32))                                                  # AES-256-SIV takes 64 bytes


def test_value_key_is_derived_from_the_secret_with_its_own_label() -> None:
    from kvstore.derive import key_names_key
    assert values_key(SECRET) == values_key(SECRET) != values_key(b"other")
    assert values_key(SECRET)[:32] != key_names_key(SECRET)                   # distinct HKDF labels
    assert values_key(SECRET, parse_aes_key(AES_KEY)) != values_key(SECRET)  # an explicit key wins


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
        assert all(len(m) == 16 + 16 for m in members)                       # continuations capped at 16 tokens
        assert server.cli("object", "encoding", key).strip() == "listpack"   # compact: ~140 bytes a key


async def test_redis_ttl_expiry(server) -> None:
    server.cli("flushall")
    cache = RedisDraftCache(server.url, deriver(), codec(), ttl_s=1)
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
    assert all(n.startswith("sm:d:") and len(n) == 27 for n in names)


async def test_redis_tenant_isolation(cache) -> None:
    cache.record("tenant:a", CONTEXT, CONTINUATION)
    await cache.flush()
    assert await cache.lookup("tenant:b", CONTEXT, 16) == []
    assert await cache.lookup("tenant:a", CONTEXT, 16) == CONTINUATION


async def test_redis_encryption_round_trip_and_wrong_key(server) -> None:
    server.cli("flushall")
    sealed = RedisDraftCache(server.url, deriver(), codec(), ttl_s=60)
    sealed.record("s", CONTEXT, CONTINUATION)
    await sealed.flush()
    assert await sealed.lookup("s", CONTEXT, 16) == CONTINUATION
    raw = redis.Redis(port=server.port).zrange(store_keys(server)[0], 0, -1)[0]
    assert pack_varints(CONTINUATION) not in raw
    other = RedisDraftCache(server.url, deriver(), ValueCodec(os.urandom(64)), ttl_s=60)   # wrong key: a miss
    assert await other.lookup("s", CONTEXT, 16) == []
    await other.close()
    await sealed.close()


@pytest.mark.parametrize("explicit_key", ["", AES_KEY], ids=["secret-only", "explicit-key"])
async def test_values_are_sealed_whenever_a_secret_is_set(server, explicit_key) -> None:
    server.cli("flushall")
    settings = CacheSettings(server.url, secret="shared-secret", encryption_key=explicit_key)
    writer, reader = (open_cache(settings, "m", "t") for _ in range(2))       # two gateways, one secret
    writer.record("s", CONTEXT, CONTINUATION)
    await writer.flush()
    client = redis.Redis(port=server.port)
    members = [m for key in store_keys(server) for m in client.zrange(key, 0, -1)]
    assert len(members) == 3 and all(pack_varints(CONTINUATION) not in m for m in members)
    assert all(len(m) == 16 + len(pack_varints(CONTINUATION)) for m in members)
    assert await reader.lookup("s", CONTEXT, 16) == CONTINUATION
    other_key = open_cache(CacheSettings(server.url, secret="shared-secret", encryption_key="11" * 32), "m", "t")
    assert await other_key.lookup("s", CONTEXT, 16) == []                      # same names, other value key
    for cache in (writer, reader, other_key):
        await cache.close()


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
    cache = RedisDraftCache(server.url, deriver(), codec(), ttl_s=60, retry_after_s=0.2)
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
        cache = RedisDraftCache(node.url.removesuffix("/0"), deriver(), codec(),
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
