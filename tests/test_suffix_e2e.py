"""Suffix drafting (`suffix_drafting=True`) through the full tiny stack: exact greedy output, repeated prompts
drafted from the shared store across two gateways on one Redis, tenant isolation, only verified tokens stored,
and the request's own context drafting without any draft service."""

from __future__ import annotations

import grpc
import pytest_asyncio
import redis
from transformers import AutoTokenizer

from kvstore.codec import ValueCodec
from kvstore.derive import key_names_key, values_key
from kvstore.keys import KeyDeriver
from kvstore.suffix_store import SUFFIX_PREFIX
from protos.specmesh.v1 import common_pb2, generate_pb2_grpc
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from tests.redis_server import RedisServer
from tests.stack import reference_greedy, start_draft, start_gateway, start_verifier
from tests.test_tiers import settle

SHARED, LOCAL, MODEL = common_pb2.DRAFT_SOURCE_CACHE, common_pb2.DRAFT_SOURCE_NGRAM, common_pb2.DRAFT_SOURCE_MODEL
SECRET = "suffix-e2e-secret"
MAX_NEW = 40
REPETITIVE = ["1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3", "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack():
    store = RedisServer().start()
    verifier = await start_verifier()
    draft = await start_draft("tiny-draft-unrelated")           # model drafts mostly rejected
    on = {"suffix_drafting": True, "enable_cache": True, "redis_url": store.url, "cache_secret": SECRET,
          "cache_read_timeout_s": 0.5}                           # a loaded test machine: no spurious misses
    first = await start_gateway(verifier.addr, draft.addr, **on)
    second = await start_gateway(verifier.addr, draft.addr, **on)
    alone = await start_gateway(verifier.addr, "", suffix_drafting=True)   # no draft service, no store: own context
    tree = await start_gateway(verifier.addr, draft.addr, suffix_drafting=True, draft_tree_width=1,
                               enable_cache=True)                           # in-process store
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    yield {"store": store, "first": first, "second": second, "alone": alone, "tree": tree, "tokenizer": tokenizer}
    for running in (first, second, alone, tree, draft, verifier):
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


def rounds(responses: list, source: int) -> list:
    return [r.round for r in responses if r.round.round > 0 and r.round.draft_source == source]


def expected(stack, prompt: str, max_new: int = MAX_NEW) -> list[int]:
    return reference_greedy(stack["tokenizer"](prompt)["input_ids"], max_new)


async def test_repeated_prompt_is_drafted_from_the_other_gateways_outputs(stack) -> None:
    for prompt in ["How do I reset my password?", "def add(a, b):\n    return"]:
        want = expected(stack, prompt)
        cold, cold_responses = await generate(stack["first"].addr, prompt, tenant="acme")
        await settle(stack["store"])
        warm, warm_responses = await generate(stack["second"].addr, prompt, tenant="acme")
        assert cold == want and warm == want
        shared = rounds(warm_responses, SHARED)
        assert shared and sum(r.num_accepted for r in shared) >= MAX_NEW // 2
        assert len(warm_responses) < len(cold_responses)              # long accepted drafts: fewer rounds
    stats = stack["second"].server.stats["drafting"]()
    assert stats["cache_hits"] > 0 and stats["cache_store_hits"] > 0


async def test_tenants_do_not_share_the_store(stack) -> None:
    prompt = "Where is my order number 51423?"
    want = expected(stack, prompt)
    await generate(stack["first"].addr, prompt, tenant="alpha")
    await settle(stack["store"])
    other, other_responses = await generate(stack["second"].addr, prompt, tenant="beta")
    same, same_responses = await generate(stack["second"].addr, prompt, tenant="alpha")
    assert other == want and same == want
    assert not rounds(other_responses, SHARED)
    assert rounds(same_responses, SHARED)


async def test_only_verified_tokens_are_stored(stack) -> None:
    prompt = "Do you ship books to Tabriz, and how long does the delivery usually take?"
    want = expected(stack, prompt)
    ids, responses = await generate(stack["first"].addr, prompt, tenant="verified-only")
    assert ids == want
    model = rounds(responses, MODEL)
    assert sum(r.num_drafted for r in model) > sum(r.num_accepted for r in model)   # rejected drafts existed
    await settle(stack["store"])
    context = stack["tokenizer"](prompt)["input_ids"] + want
    start = len(context) - len(want)
    deriver = KeyDeriver(key_names_key(SECRET.encode()), "tiny-target", "tiny-target", (8,), prefix=SUFFIX_PREFIX)
    store, codec = redis.Redis(port=stack["store"].port), ValueCodec(values_key(SECRET.encode()))
    tails = [tuple(context[start + p - 8:start + p]) for p in range(len(want))]
    checked = 0
    for p in range(len(want)):
        if tails.count(tails[p]) > 1:
            continue                                      # a repeated 8-gram legitimately has several
        (key,) = deriver.keys("tenant:verified-only", context[:start + p])
        members = [codec.decode(key, m) for m in store.zrange(key, 0, -1)]
        assert members == [want[p:p + 16]]                # exactly the verified continuation, nothing drafted
        checked += 1
    assert checked > len(want) // 2
    assert not [k for k in store.keys("*") if not k.decode().startswith(SUFFIX_PREFIX)]   # no draft-cache keys


async def test_own_context_drafts_without_a_draft_service(stack) -> None:
    total = 0
    for prompt in REPETITIVE:
        want = expected(stack, prompt)
        ids, responses = await generate(stack["alone"].addr, prompt)
        assert ids == want
        assert not rounds(responses, MODEL)
        total += len(rounds(responses, LOCAL))          # the random tiny target rarely repeats itself, so these
    assert total > 0                                    # are mostly rejected; what they propose: test_suffix_tree
    ids, _ = await generate(stack["alone"].addr, "1, 2, 3, 1, 2, 3, 1, 2", temperature=0.8, seed=5)
    assert len(ids) == MAX_NEW                                    # one-hot drafts under sampling


async def test_tree_drafts_keep_greedy_output(stack) -> None:
    """Suffix branches and model + suffix trees through the verifier's tree verification: the output stays exact,
    and a repeated prompt's store drafts are its exact output. How many rounds the store drafts is the choice's
    (gateway/suffix_choice.py): the tiny model verifies in milliseconds, so a lookup slowed by the engine threads'
    GIL can cost more than its tokens save, and then the store drafts only the probe rounds."""
    for prompt in [*REPETITIVE, "How do I reset my password?"]:
        ids, _ = await generate(stack["tree"].addr, prompt)
        assert ids == expected(stack, prompt)
    ids, responses = await generate(stack["tree"].addr, "How do I reset my password?")
    assert ids == expected(stack, "How do I reset my password?")
    shared = rounds(responses, SHARED)
    assert shared and all(r.num_accepted == r.num_drafted for r in shared)
