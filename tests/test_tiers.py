"""Drafting tiers through the full gRPC stack: cache hits, garbage in Redis, Redis outages and prompt lookup never
change greedy output; plus unit tests of the n-gram lookup."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import pytest_asyncio
import redis
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from gateway.proposers.base import Draft, VerifiedTokens
from gateway.proposers.compose import build_policy
from gateway.tiers import DraftTiers, TierSettings, tenant_from_metadata
from gateway.validation import GenerationParams
from kvstore.codec import ValueCodec
from kvstore.derive import key_names_key, values_key
from kvstore.keys import KeyDeriver
from kvstore.memory import MemoryDraftCache
from protos.specmesh.v1 import common_pb2, generate_pb2_grpc
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from specmesh.spec.ngram import propose_ngram
from specmesh.spec.sampling import SamplingParams
from tests.redis_server import RedisServer
from tests.stack import reference_greedy, start_draft, start_gateway, start_verifier

CACHE, NGRAM, MODEL = common_pb2.DRAFT_SOURCE_CACHE, common_pb2.DRAFT_SOURCE_NGRAM, common_pb2.DRAFT_SOURCE_MODEL
PROMPTS = ["How do I reset my password?", "What are your opening hours?", "def add(a, b):\n    return"]
MAX_NEW = 40


def brute_ngram(context: list[int], sizes: list[int], max_tokens: int) -> list[int]:
    for n in sorted(sizes, reverse=True):
        if len(context) <= n:
            continue
        tail = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):
            if context[i:i + n] == tail:
                return context[i + n:i + n + max_tokens]
    return []


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    assert propose_ngram([1, 2, 3, 9, 8, 1, 2, 3, 7, 1, 2, 3], [3, 2], 4) == [7, 1, 2, 3]
    assert propose_ngram([1, 2, 3, 9, 8, 4, 2, 3], [3, 2], 3) == [9, 8, 4]          # falls back to the bigram
    assert propose_ngram([1, 2, 3, 4], [2], 5) == []
    assert propose_ngram([5, 5, 5], [2], 5) == [5]
    assert propose_ngram([1, 2, 1, 2], [2], 0) == []
    # 256 = bytes 00 01 00 00: a byte-level match across token boundaries must not count.
    assert propose_ngram([1, 256, 0, 7, 1, 0], [2], 2) == []


@given(st.lists(st.integers(0, 5), max_size=60), st.integers(1, 8))
def test_ngram_matches_brute_force_small_vocab(context: list[int], max_tokens: int) -> None:
    assert propose_ngram(context, [4, 3, 2], max_tokens) == brute_ngram(context, [4, 3, 2], max_tokens)


@given(st.lists(st.sampled_from([0, 1, 256, 65536, 16777216, 2**32 - 1]), max_size=40))
def test_ngram_matches_brute_force_byte_aliasing(context: list[int]) -> None:
    assert propose_ngram(context, [3, 1], 5) == brute_ngram(context, [3, 1], 5)


def test_tenant_comes_from_metadata() -> None:
    assert tenant_from_metadata(None) == "default"
    assert tenant_from_metadata((("x-other", "a"), ("x-specmesh-tenant", "acme"))) == "acme"
    assert tenant_from_metadata((("x-specmesh-tenant", b"acme"),)) == "acme"


@pytest.mark.parametrize("shared", [False, True])
async def test_cache_scope_is_per_tenant_unless_shared(shared: bool) -> None:
    tiers = DraftTiers(TierSettings(vocab_size=1000, shared_scope=shared, enable_ngram=False),
                       MemoryDraftCache(KeyDeriver(b"k", "m", "t", (8, 4, 2)), ttl_s=60))
    params = GenerationParams("r", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(), 32, (), 4, True)
    output = [11, 12, 13, 14, 15, 16]
    writer = build_policy(tiers, None, "alpha")
    writer.observe(Draft([], None, common_pb2.DRAFT_SOURCE_NONE), 0, VerifiedTokens(params.prompt_ids, output))
    await writer.close()                                          # records every verified position
    context = params.prompt_ids + output[:2]
    room = params.max_new_tokens - 2 - 1                          # RequestState.draft_room after 2 tokens
    assert (await build_policy(tiers, None, "alpha").propose(context, 4, room)).token_ids == output[2:]
    other = await build_policy(tiers, None, "beta").propose(context, 4, room)
    assert other.token_ids == (output[2:] if shared else [])
    assert tiers.snapshot()["cache_hits"] == (2 if shared else 1)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack():
    store = RedisServer().start()
    verifier = await start_verifier()
    draft = await start_draft("tiny-draft-unrelated")          # model drafts mostly rejected: cache hits stand out
    memory = await start_gateway(verifier.addr, draft.addr, enable_cache=True)
    # A loaded test machine must not turn cache reads into misses (the 50 ms default is for production).
    on_redis = await start_gateway(verifier.addr, draft.addr, enable_cache=True, redis_url=store.url,
                                   cache_secret="test-secret", cache_read_timeout_s=1.0)
    ngram = await start_gateway(verifier.addr, "", enable_ngram=True)
    same = await start_draft("tiny-draft")                      # identical weights: its drafts are always right
    mixed = await start_gateway(verifier.addr, same.addr, enable_cache=True, redis_url=store.url,
                                cache_secret="mixed-secret", cache_read_timeout_s=1.0)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    yield {"store": store, "memory": memory, "redis": on_redis, "ngram": ngram, "mixed": mixed,
           "tokenizer": tokenizer}
    for running in (memory, on_redis, ngram, mixed, same, draft, verifier):
        await running.stop()
    store.kill()


async def generate(addr: str, prompt: str, tenant: str | None = None, **kwargs) -> tuple[list[int], list]:
    kwargs = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "num_draft_tokens": 4, **kwargs}
    metadata = (("x-specmesh-tenant", tenant),) if tenant else None
    async with grpc.aio.insecure_channel(addr) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(client.make_request(prompt, **kwargs),
                                                                   metadata=metadata, timeout=120)
        responses = [r async for r in call]
    return [t for r in responses for t in r.token_ids], responses


async def settle(store: RedisServer, timeout_s: float = 5.0) -> None:
    """Waits until the write-behind has reached Redis: the key count held still for 0.2 s (a loaded machine may
    take longer than the usual few milliseconds)."""
    client, last, still = redis.Redis(port=store.port), -1, 0
    for _ in range(int(timeout_s / 0.05)):
        size = client.dbsize()
        still = still + 1 if size == last else 0
        if still >= 4:
            return
        last = size
        await asyncio.sleep(0.05)


def rounds(responses: list, source: int) -> list:
    return [r.round for r in responses if r.round.round > 0 and r.round.draft_source == source]


def expected(stack, prompt: str, max_new: int = MAX_NEW) -> list[int]:
    return reference_greedy(stack["tokenizer"](prompt)["input_ids"], max_new)


@pytest.mark.parametrize("gateway", ["memory", "redis"])
async def test_cache_hits_keep_greedy_output(stack, gateway: str) -> None:
    stats = stack[gateway].server.stats["drafting"]
    for prompt in PROMPTS:
        want = expected(stack, prompt)
        cold, cold_responses = await generate(stack[gateway].addr, prompt, tenant=f"t-{gateway}")
        before = stats()
        await settle(stack["store"])                                  # write-behind reaches Redis
        warm, warm_responses = await generate(stack[gateway].addr, prompt, tenant=f"t-{gateway}")
        after = stats()
        assert cold == want and warm == want
        hits = rounds(warm_responses, CACHE)
        assert hits and all(r.num_accepted == r.num_drafted for r in hits)
        assert len(warm_responses) < len(cold_responses)              # longer drafts: fewer rounds
        assert after["draft_bytes_sent"] - before["draft_bytes_sent"] < before["draft_bytes_sent"] / 2
    snapshot = stats()
    assert snapshot["cache_hits"] > 0 and snapshot["cache_accepted"] == snapshot["cache_drafted"]
    assert snapshot["model_hits"] > 0 and snapshot["draft_bytes_received"] > 0


async def test_tenants_do_not_share_the_cache(stack) -> None:
    prompt = "Where is my order number 51423?"
    await generate(stack["redis"].addr, prompt, tenant="alpha")
    await settle(stack["store"])
    _, other = await generate(stack["redis"].addr, prompt, tenant="beta")
    _, same = await generate(stack["redis"].addr, prompt, tenant="alpha")
    assert not rounds(other, CACHE)
    assert rounds(same, CACHE)


async def test_only_verified_tokens_are_cached(stack) -> None:
    prompt = "Do you ship books to Tabriz, and how long does the delivery usually take?"
    want = expected(stack, prompt)
    ids, responses = await generate(stack["redis"].addr, prompt, tenant="verified-only")
    assert ids == want
    model = rounds(responses, MODEL)
    assert sum(r.num_drafted for r in model) > sum(r.num_accepted for r in model)   # rejected drafts existed
    await settle(stack["store"])
    context = stack["tokenizer"](prompt)["input_ids"] + want
    start = len(context) - len(want)
    deriver = KeyDeriver(key_names_key(b"test-secret"), "tiny-target", "tiny-target", (8,))
    client, codec = redis.Redis(port=stack["store"].port), ValueCodec(values_key(b"test-secret"))
    tails = [tuple(context[start + p - 8:start + p]) for p in range(len(want))]
    checked = 0
    for p in range(len(want)):
        if tails.count(tails[p]) > 1:
            continue                                      # a repeated 8-gram legitimately has several
        checked += 1
        (key,) = deriver.keys("tenant:verified-only", context[:start + p])
        members = [codec.decode(key, m) for m in client.zrange(key, 0, -1)]
        assert members == [want[p:p + 16]]                # exactly the verified continuation, nothing drafted
    assert checked > len(want) // 2


def poison(store: RedisServer, vocab_size: int) -> int:
    """Puts wrong but decodable drafts on top of every cached key, and garbage beside them."""
    client, codec, rng = redis.Redis(port=store.port), ValueCodec(values_key(b"test-secret")), random.Random(7)
    keys = client.keys("sm:d:*")
    for i, key in enumerate(keys):
        name = key.decode()
        if i % 10 == 9:
            client.delete(key)
            client.set(key, b"\x00garbage")                           # wrong type
            continue
        wrong = [rng.randrange(vocab_size) for _ in range(16)]
        if i % 3 == 0:
            wrong[rng.randrange(16)] = vocab_size + rng.randrange(2**31)   # out of vocabulary
        client.zadd(key, {codec.encode(name, wrong): 10_000,
                          bytes(rng.randrange(256) for _ in range(23)): 20_000})   # undecodable
    return len(keys)


async def test_garbage_in_redis_does_not_change_output(stack) -> None:
    prompt = "Can I return a book I bought last week?"
    want = expected(stack, prompt)
    first, _ = await generate(stack["redis"].addr, prompt, tenant="g")
    await settle(stack["store"])
    assert poison(stack["store"], stack["tokenizer"].vocab_size) > 0
    ids, responses = await generate(stack["redis"].addr, prompt, tenant="g")
    assert first == want and ids == want
    hits = rounds(responses, CACHE)
    assert hits and any(r.num_accepted < r.num_drafted for r in hits)  # the wrong drafts were really proposed
    ids, _ = await generate(stack["redis"].addr, prompt, tenant="g", temperature=0.7, seed=3)
    assert len(ids) == MAX_NEW


async def test_redis_killed_mid_run(stack) -> None:
    prompt, max_new = "Tell me a long story about a lighthouse keeper.", 160
    want = expected(stack, prompt, max_new)
    store, addr = stack["store"], stack["redis"].addr
    request = client.make_request(prompt, max_new_tokens=max_new, ignore_eos=True, num_draft_tokens=4)
    ids: list[int] = []
    async with grpc.aio.insecure_channel(addr) as channel:
        async for response in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
            ids.extend(response.token_ids)
            if response.round.round == 3:
                store.kill()
    assert ids == want
    store.start()                                                     # same port, empty: the cache recovers
    for _ in range(10):
        await asyncio.sleep(1.1)
        again, responses = await generate(addr, prompt, max_new_tokens=max_new)
        assert again == want
        if rounds(responses, CACHE):
            break
    assert rounds(responses, CACHE)


async def test_prompt_lookup_keeps_greedy_output(stack) -> None:
    prompts = ["1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3", "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef"]
    total = 0
    for prompt in prompts:
        want = expected(stack, prompt)
        ids, responses = await generate(stack["ngram"].addr, prompt)
        assert ids == want
        total += len(rounds(responses, NGRAM))
        assert not rounds(responses, MODEL)                           # no draft service configured
    assert total > 0



async def test_draft_service_catches_up_after_local_rounds(stack) -> None:
    """Cache rounds skip the draft service; its next Propose must bring it exactly up to date again."""
    prompt, max_new = "The lighthouse keeper wrote in his log", 96
    want = expected(stack, prompt, max_new)
    ids, _ = await generate(stack["mixed"].addr, prompt, tenant="mix", max_new_tokens=max_new)
    await settle(stack["store"])
    context = stack["tokenizer"](prompt)["input_ids"] + want
    deriver = KeyDeriver(key_names_key(b"mixed-secret"), "tiny-target", "tiny-target", (8, 4, 2))
    start = len(context) - max_new
    gaps = [k for p in [*range(0, 20), *range(50, 70)] for k in deriver.keys("tenant:mix", context[:start + p])]
    assert redis.Redis(port=stack["store"].port).delete(*gaps) > 0       # forget two stretches of the answer
    ids, responses = await generate(stack["mixed"].addr, prompt, tenant="mix", max_new_tokens=max_new)
    assert ids == want
    model, cached = rounds(responses, MODEL), rounds(responses, CACHE)
    assert model and all(r.num_accepted == r.num_drafted for r in model)  # the draft service was in sync
    assert any(m.round > c.round for m in model for c in cached) and cached[0].round > model[0].round
