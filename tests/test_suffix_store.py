"""The suffix drafting store against a real redis-server (and in-process): continuation counts per matched suffix,
key and value format (keyed names, sealed values, no token ids or text anywhere), tenant isolation (store and
drafter), and garbage, outages and hangs read as misses."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import pytest_asyncio
import redis

from gateway.proposers.base import Draft, VerifiedTokens
from gateway.proposers.compose import build_policy
from gateway.tiers import DraftTiers, TierSettings
from gateway.validation import GenerationParams
from kvstore.codec import ValueCodec, pack_varints
from kvstore.derive import key_names_key, values_key
from kvstore.factory import CacheSettings
from kvstore.keys import KeyDeriver
from kvstore.suffix_store import SUFFIX_PREFIX, MemorySuffixStore, RedisSuffixStore, open_suffix_store
from protos.specmesh.v1 import common_pb2
from specmesh.spec.sampling import SamplingParams
from tests.redis_server import RedisServer

SECRET = "suffix-secret"
CONTEXT = [101, 7, 2024, 55, 9, 31337, 12, 8, 4242]
FIRST, SECOND = [77, 88, 99, 1234], [77, 88, 5]


def settings(url: str = "", **kwargs: object) -> CacheSettings:
    return CacheSettings(url, secret=SECRET, **kwargs)


@pytest.fixture(scope="module")
def server():
    srv = RedisServer().start()
    yield srv
    srv.kill()


@pytest_asyncio.fixture(loop_scope="session")
async def store(server):
    server.cli("flushall")
    s = open_suffix_store(settings(server.url), "tiny-target", "tiny-target")
    assert isinstance(s, RedisSuffixStore)
    s.retry_after_s = 0.2
    yield s
    await s.close()


def names(server: RedisServer) -> list[str]:
    return [k for k in server.cli("keys", "*").split() if k]


async def fill(store: MemorySuffixStore | RedisSuffixStore) -> None:
    for continuation in (FIRST, FIRST, SECOND):
        store.record("tenant:a", CONTEXT, continuation)
    if isinstance(store, RedisSuffixStore):
        await store.flush()


def by_len(hits: list) -> dict[int, dict[tuple[int, ...], int]]:
    return {n: {tuple(c): count for c, count in found} for n, found in hits}


@pytest.mark.parametrize("where", ["memory", "redis"])
async def test_counts_per_matched_suffix_longest_first(server, where: str) -> None:
    server.cli("flushall")
    s = open_suffix_store(settings(server.url if where == "redis" else ""), "m", "t")
    await fill(s)
    hits = await s.lookup_counts("tenant:a", CONTEXT)
    assert [n for n, _ in hits] == [8, 4, 2]
    assert by_len(hits)[8] == {tuple(FIRST): 2, tuple(SECOND): 1}
    # a context that shares only its last 4 tokens matches the 4- and 2-token nodes
    assert [n for n, _ in await s.lookup_counts("tenant:a", [1, 2, 3, 4, *CONTEXT[-4:]])] == [4, 2]
    assert await s.lookup_counts("tenant:a", [1, 2, 3]) == []
    await s.close()


async def test_two_gateways_share_one_store(server) -> None:
    server.cli("flushall")
    writer, reader = (open_suffix_store(settings(server.url), "m", "t") for _ in range(2))
    await fill(writer)
    assert by_len(await reader.lookup_counts("tenant:a", CONTEXT))[8] == {tuple(FIRST): 2, tuple(SECOND): 1}
    stranger = open_suffix_store(CacheSettings(server.url, secret="another"), "m", "t")
    assert await stranger.lookup_counts("tenant:a", CONTEXT) == []            # other secret: other names
    for s in (writer, reader, stranger):
        await s.close()


async def test_tenant_isolation(store) -> None:
    await fill(store)
    assert await store.lookup_counts("tenant:b", CONTEXT) == []
    assert await store.lookup_counts("tenant:a", CONTEXT)


async def test_key_and_value_format_hides_tokens_and_text(store, server) -> None:
    text_ids = list(b"password reset")
    store.record("tenant:acme", [*CONTEXT, *text_ids], FIRST)
    await store.flush()
    keys = names(server)
    assert len(keys) == 3 and all(k.startswith(SUFFIX_PREFIX) and len(k) == 27 for k in keys)
    dump = " ".join(keys)
    assert "acme" not in dump and "password" not in dump and "tiny" not in dump
    for token in [*CONTEXT, *text_ids, *FIRST]:
        assert str(token) not in dump.replace(SUFFIX_PREFIX, "") or len(str(token)) < 3
    client = redis.Redis(port=server.port)
    deriver = KeyDeriver(key_names_key(SECRET.encode()), "tiny-target", "tiny-target", (8, 4, 2),
                         prefix=SUFFIX_PREFIX)
    assert sorted(keys) == sorted(deriver.keys("tenant:acme", [*CONTEXT, *text_ids]))   # HMAC names, as documented
    codec = ValueCodec(values_key(SECRET.encode()))
    for key in keys:
        ((member, count),) = client.zrange(key, 0, -1, withscores=True)
        assert count == 1 and pack_varints(FIRST) not in member and bytes(text_ids) not in member
        assert len(member) == 16 + len(pack_varints(FIRST))                   # SIV + ciphertext, nothing else
        assert codec.decode(key, member) == FIRST                              # sealed to its own key name
        assert codec.decode(keys[0] if key != keys[0] else keys[1], member) is None


async def test_garbage_is_skipped_or_a_miss(store, server) -> None:
    await fill(store)
    long_key, mid_key, short_key = store.keys.keys("tenant:a", CONTEXT)
    client = redis.Redis(port=server.port)
    client.zadd(long_key, {b"\xff\xfe garbage": 1000, b"": 999})
    client.zadd(long_key, {store.codec.encode(long_key, [1, 2]): 1e300})      # sealed, absurd count
    client.delete(mid_key)
    client.set(mid_key, b"not a sorted set")
    hits = by_len(await store.lookup_counts("tenant:a", CONTEXT))
    assert set(hits) == {8, 2}                                                 # the wrong-type key is a miss
    assert tuple(FIRST) in hits[8] and (1, 2) not in hits[8]
    client.delete(long_key, short_key)
    client.hset(long_key, "a", "b")
    assert await store.lookup_counts("tenant:a", CONTEXT) == []
    store.record("tenant:a", CONTEXT, FIRST)                                   # writes over garbage: no error
    await store.flush()
    assert store.counters.errors == 0


async def test_down_and_hung_are_fast_misses(server) -> None:
    server.cli("flushall")
    s = open_suffix_store(settings(server.url), "m", "t")
    assert isinstance(s, RedisSuffixStore)
    s.retry_after_s = 0.2
    await fill(s)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert await s.lookup_counts("tenant:a", CONTEXT) == []
        # A hung server costs the 50 ms read timeout, not a hang (without it this read never returns); the bound
        # leaves a loaded 2-core CI room (0.42 s seen once with the suite's other threads running beside it).
        assert time.monotonic() - start < 1.0
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    server.kill()
    try:
        await asyncio.sleep(0.25)
        start = time.monotonic()
        assert await s.lookup_counts("tenant:a", CONTEXT) == []
        s.record("tenant:a", CONTEXT, FIRST)
        await s.flush()
        assert time.monotonic() - start < 1.0 and s.counters.errors >= 2
    finally:
        server.start()
    for _ in range(10):                                                        # recovers (an empty store)
        await asyncio.sleep(0.3)
        await fill(s)
        if await s.lookup_counts("tenant:a", CONTEXT):
            break
    assert await s.lookup_counts("tenant:a", CONTEXT)
    await s.close()


@pytest.mark.parametrize("shared", [False, True])
async def test_drafter_scope_is_per_tenant_unless_shared(shared: bool) -> None:
    store = open_suffix_store(settings(), "m", "t")
    tiers = DraftTiers(TierSettings(vocab_size=1000, shared_scope=shared, suffix_drafting=True), None, store=store)
    params = GenerationParams("r", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(), 32, (), 4, True)
    output = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    writer = build_policy(tiers, None, "alpha")
    writer.observe(Draft([], None, common_pb2.DRAFT_SOURCE_NONE), 0, VerifiedTokens(params.prompt_ids, output))
    await writer.close()                                          # records every verified position
    context = params.prompt_ids + output[:2]
    room = params.max_new_tokens - 2 - 1                          # RequestState.draft_room after 2 tokens
    draft = await build_policy(tiers, None, "alpha").propose(context, 4, room)
    assert draft.source == common_pb2.DRAFT_SOURCE_CACHE and draft.token_ids == output[2:]
    other = await build_policy(tiers, None, "beta").propose(context, 4, room)
    assert other.token_ids == (output[2:] if shared else [])
    assert tiers.snapshot()["cache_hits"] == (2 if shared else 1)


async def test_drafter_proposes_a_tree_where_two_continuations_are_frequent() -> None:
    prompt = [5, 1, 2, 3, 9, 9, 6, 1, 2, 3, 8, 8, 7, 1, 2]
    params = GenerationParams("r", prompt, SamplingParams(), 32, (), 4, True)
    tiers = DraftTiers(TierSettings(vocab_size=1000, suffix_drafting=True, max_branches=2), None)
    room = params.max_new_tokens - 1 - 1
    draft = await build_policy(tiers, None, "alpha").propose(prompt + [3], 4, room)   # "1 2 3": then 9 9 6 or 8 8 7
    assert draft.source == common_pb2.DRAFT_SOURCE_NGRAM
    assert draft.parents is not None
    paths = {tuple(draft.token_ids[j] for j in path) for path in _leaf_paths(draft.parents)}
    assert paths == {(8, 8, 7), (9, 9, 6)}                     # 3 matched tokens: at most 6 nodes
    assert tiers.snapshot()["tree_drafts"] == 1
    chains = DraftTiers(TierSettings(vocab_size=1000, suffix_drafting=True), None)
    chain = await build_policy(chains, None, "alpha").propose(prompt + [3], 4, room)
    assert chain.parents is None and chain.token_ids == [8, 8, 7, 1, 2, 3]    # a tie: the smaller id (p = 0.5)


def _leaf_paths(parents: list[int]) -> list[list[int]]:
    leaves = set(range(len(parents))) - set(parents)
    out = []
    for leaf in sorted(leaves):
        path, node = [], leaf
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        out.append(path)
    return out
