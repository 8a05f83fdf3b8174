"""Fair share: per-tenant stream and queued-token limits from the keys file (gateway/quotas.py), refusals with a
retry hint (gRPC grpc-retry-pushback-ms, HTTP Retry-After) counted per tenant, and the verifier's admission share
for tenants that hold nothing (verifier_service/tenant_share.py)."""

from __future__ import annotations

import aiohttp
import grpc
import pytest
import pytest_asyncio

from gateway.openai_http import ServedModel, start_openai_http
from gateway.quotas import (
    Refusal,
    TenantLimits,
    TenantQuotas,
    Ticket,
    parse_limits,
    parse_tenant_limits,
    retry_after_header,
)
from gateway.replicas import VerifierPool
from gateway.server import load_tokenizer
from gateway.servicer import GenerationServicer, ModelInfo
from protos.specmesh.v1 import common_pb2, generate_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specmesh.config import EngineConfig, GatewayConfig, VerifierConfig
from specmesh.engine.errors import EngineError
from specmesh.ops import client
from specmesh.rpc.security import parse_api_keys
from tests.stack import Running, start_gateway, start_verifier
from verifier_service.server import build_verifier
from verifier_service.tenant_share import TenantShare

KEYS = "key-a:acme:streams=2,key-b:beta,key-c:gamma:tokens=1"
PROMPT = "Where is my order number 51423?"


def test_limits_are_parsed_from_key_entries() -> None:
    entries = ["key-a:acme:streams=2,tokens=500", "key-a2:acme:streams=2,tokens=500", "key-b:beta", "key-c"]
    assert parse_api_keys(entries) == {"key-a": "acme", "key-a2": "acme", "key-b": "beta", "key-c": ""}
    assert parse_tenant_limits(entries) == {"acme": TenantLimits(2, 500)}
    assert parse_limits("tokens=7", "x") == TenantLimits(0, 7)
    config = GatewayConfig(api_keys="key-a:acme:streams=2;tokens=500,key-b:beta")      # `;` inside the variable
    assert TenantQuotas.from_config(config).limits == {"acme": TenantLimits(2, 500)}
    for bad in ("streams=-1", "stream=2", "streams=two", "streams", "rate=1.5"):
        with pytest.raises(ValueError, match="streams=N,tokens=N,rate=N"):
            parse_limits(bad, "API key entry 1")
    with pytest.raises(ValueError, match="already has other limits") as info:
        parse_tenant_limits(["key-a:acme:streams=2", "key-x:acme:streams=3"])
    assert "key-" not in str(info.value)                                 # errors never echo a key


def test_quotas_count_streams_and_queued_tokens() -> None:
    quotas = TenantQuotas({"acme": TenantLimits(max_streams=2, max_queued_tokens=100)}, TenantLimits(), 2.5,
                          {"key-a": "acme"})
    first, second = quotas.admit("acme", 40), quotas.admit("acme", 40)
    assert isinstance(first, Ticket) and isinstance(second, Ticket)
    third = quotas.admit("acme", 1)
    assert isinstance(third, Refusal) and third.limit == "streams" and third.retry_after_s == 2.5
    assert "its limit is 2" in third.message
    first.release()
    first.release()                                                    # idempotent
    over = quotas.admit("acme", 61)
    assert isinstance(over, Refusal) and over.limit == "tokens" and "its limit is 100" in over.message
    assert isinstance(quotas.admit("acme", 60), Ticket)
    assert all(isinstance(quotas.admit("anyone", 10**6), Ticket) for _ in range(50))   # no limits: any
    assert quotas.label("acme") == "acme" and quotas.label("anyone") == "other"


def test_a_token_rate_refuses_with_the_time_until_the_bucket_holds_the_request() -> None:
    now = [0.0]
    quotas = TenantQuotas({"acme": TenantLimits(tokens_per_s=100)}, TenantLimits(), clock=lambda: now[0])
    for _ in range(5):                                                 # the bucket holds 10 s x 100 tokens
        ticket = quotas.admit("acme", 200)
        assert isinstance(ticket, Ticket)
        ticket.release()
    refused = quotas.admit("acme", 50)
    assert isinstance(refused, Refusal) and refused.limit == "rate" and refused.retry_after_s == 0.5
    now[0] = 0.5                                                       # 50 tokens refilled
    assert isinstance(quotas.admit("acme", 50), Ticket)
    too_big = quotas.admit("acme", 1001)
    assert isinstance(too_big, Refusal) and "more than tenant 'acme' may start in 10 s" in too_big.message
    assert parse_limits("rate=100,streams=1", "x") == TenantLimits(max_streams=1, tokens_per_s=100)


def test_retry_after_comes_from_the_pushback() -> None:
    assert retry_after_header((("grpc-retry-pushback-ms", "1000"),)) == {"Retry-After": "1"}
    assert retry_after_header((("grpc-retry-pushback-ms", "1500"),)) == {"Retry-After": "2"}
    assert retry_after_header((("other", "1"),)) == {} and retry_after_header(None) == {}


def test_the_last_sessions_go_to_tenants_that_hold_none() -> None:
    share = TenantShare(max_sessions=4, reserve=1)
    open_ids: set[str] = set()
    for i in range(3):
        share.admit(f"a{i}", "acme", open_ids)
        open_ids.add(f"a{i}")
    with pytest.raises(EngineError) as info:
        share.admit("a3", "acme", open_ids)                            # acme may not take the last slot
    assert info.value.code == "RESOURCE_EXHAUSTED" and "tenants that hold none" in str(info.value)
    share.admit("b0", "beta", open_ids)                                # beta holds nothing: it may
    open_ids.discard("a0")                                             # an acme session ended (any way)
    share.admit("a4", "acme", open_ids)
    share.admit("u0", "", open_ids)                                    # untagged callers are not refused
    assert TenantShare(1, 5).reserve == 0                              # someone can always get a session


async def test_verifier_keeps_a_share_for_other_tenants() -> None:
    config = VerifierConfig(port=0, tenant_reserve_sessions=1,
                            engine=EngineConfig(model="tiny-target", kv_cache_memory_mb=16, max_num_seqs=1))
    server, engine = build_verifier(config)                            # 4 sessions at most (max_num_seqs * 4)
    verifier = Running(server, await server.start("127.0.0.1", 0), engine)
    try:
        async with grpc.aio.insecure_channel(verifier.addr) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)

            async def start(session_id: str, tenant: str) -> verifier_pb2.StartSessionResponse:
                return await stub.StartSession(verifier_pb2.StartSessionRequest(
                    session_id=session_id, prompt_token_ids=[5, 6, 7], tenant=tenant), timeout=60)

            tokens = {f"a{i}": (await start(f"a{i}", "acme")).owner_token for i in range(3)}
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await start("a3", "acme")
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            tokens["b0"] = (await start("b0", "beta")).owner_token
            for session_id, token in tokens.items():
                await stub.EndSession(common_pb2.EndSessionRequest(session_id=session_id, owner_token=token))
    finally:
        await verifier.stop()


class Context:
    """A client of the servicer with metadata; abort records its trailing metadata."""

    def __init__(self, key: str) -> None:
        self.metadata = (("authorization", f"Bearer {key}"),)
        self.trailing: tuple = ()

    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple:
        return self.metadata

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()) -> None:
        self.trailing = trailing_metadata
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing_metadata), details)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def verifier():
    running = await start_verifier()
    yield running
    await running.stop()


async def test_one_key_over_its_stream_limit_does_not_stop_another(verifier: Running) -> None:
    channel = grpc.aio.insecure_channel(verifier.addr)
    stub = verifier_pb2_grpc.VerifierStub(channel)
    info = await stub.GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=30)
    config = GatewayConfig(api_keys=KEYS, enable_cache=False, enable_ngram=False, suffix_drafting=False,
                           adaptive_draft_length=False)
    servicer = GenerationServicer(config, load_tokenizer("tiny-target", ""),
                                  ModelInfo(info.model_name, info.max_model_len, frozenset(info.eos_token_ids)),
                                  VerifierPool.of_stubs([stub]), None)
    request = client.make_request(PROMPT, max_new_tokens=40, ignore_eos=True)
    paused = [servicer._run(request, Context("key-a")) for _ in range(2)]
    try:
        for stream in paused:                   # each reads its first token, then nothing
            await anext(stream)
        refused = Context("key-a")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await anext(servicer._run(request, refused))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "its limit is 2" in err.value.details()
        assert refused.trailing == (("grpc-retry-pushback-ms", "1000"),)
        other = [r async for r in servicer._run(request, Context("key-b"))]   # beta is served meanwhile
        assert sum(len(r.token_ids) for r in other) == 40
        registry = servicer.metrics.registry
        assert registry.get_sample_value("specmesh_tenant_refusals_total",
                                         {"tenant": "acme", "limit": "streams"}) == 1
        assert registry.get_sample_value("specmesh_tenant_streams", {"tenant": "acme"}) == 2
    finally:
        for stream in paused:
            await stream.aclose()               # the client leaves: its share is released
        await channel.close()
    assert servicer.quotas.streams["acme"] == 0
    assert servicer.metrics.registry.get_sample_value("specmesh_tenant_streams", {"tenant": "acme"}) == 0


async def test_refusals_carry_a_retry_hint_on_grpc_and_http(verifier: Running) -> None:
    gateway = await start_gateway(verifier.addr, "", api_keys=KEYS)
    http = await start_openai_http(ServedModel("tiny-target", 1024, 0), "127.0.0.1", 0, lambda: gateway.addr)
    try:
        async with grpc.aio.insecure_channel(gateway.addr) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate_pb2_grpc.GenerationStub(channel).Complete(
                    client.make_request(PROMPT, max_new_tokens=4), metadata=(("authorization", "Bearer key-c"),),
                    timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "gamma" in info.value.details()
        assert ("grpc-retry-pushback-ms", "1000") in tuple(info.value.trailing_metadata())
        body = {"model": "tiny-target", "prompt": PROMPT, "max_tokens": 4}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{http.port}/v1/completions", json=body,
                                    headers={"authorization": "Bearer key-c"}) as response:
                assert response.status == 429 and response.headers["Retry-After"] == "1"
                assert (await response.json())["error"]["type"] == "rate_limit_error"
            async with session.post(f"http://127.0.0.1:{http.port}/v1/completions", json=body,
                                    headers={"authorization": "Bearer key-b"}) as response:
                assert response.status == 200 and "Retry-After" not in response.headers
    finally:
        await http.close()
        await gateway.stop()
