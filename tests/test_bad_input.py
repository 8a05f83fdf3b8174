"""Bad input gets a clear gRPC status naming the field, never a crash; health and reflection answer."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.specmesh.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from specmesh.ops import client
from tests.stack import start_draft, start_gateway, start_verifier


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack():
    verifier = await start_verifier(max_model_len=256)
    draft = await start_draft()
    gateway = await start_gateway(verifier.addr, draft.addr)
    yield {"gateway": gateway, "verifier": verifier, "draft": draft}
    for running in (gateway, draft, verifier):
        await running.stop()


async def call_generate(addr: str, request: generate_pb2.GenerateRequest) -> list[generate_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(addr) as channel:
        return [r async for r in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)]


BAD_REQUESTS = [
    (client.make_request(""), "prompt"),
    (client.make_request("   "), "prompt"),
    (client.make_request("hi", temperature=-0.5), "temperature"),
    (client.make_request("hi", top_p=1.5), "top_p"),
    (client.make_request("hi", top_p=-0.1), "top_p"),
    (client.make_request("hi", max_new_tokens=10_000_000), "max_new_tokens"),
    (client.make_request("hi", max_new_tokens=255), "context length"),        # prompt + max_new_tokens > 256
    (client.make_request("hi", num_draft_tokens=1000), "num_draft_tokens"),
    (client.make_request("hi", stop=["x"] * 100), "stop"),
    (client.make_request("hi", stop=[""]), "stop[0]"),
    (client.make_request("x" * 300_000), "prompt"),
    (client.make_request("hi", messages=[("user", "hi")]), "prompt or messages"),
    (client.make_request(messages=[("robot", "hi")]), "messages[0].role"),
    (generate_pb2.GenerateRequest(prompt="hi", request_id="r" * 500), "request_id"),
    (client.make_request("hi", temperature=1.0, min_p=1.5), "sampling.min_p"),
    (client.make_request("hi", repetition_penalty=-1.0), "sampling.repetition_penalty"),
    (client.make_request("hi", repetition_penalty=1000.0), "sampling.repetition_penalty"),
    (client.make_request("hi", logit_bias={10**6: 1.0}), "sampling.logit_bias: token id 1000000"),
    (client.make_request("hi", logit_bias={3: 500.0}), "sampling.logit_bias[3]"),
    (client.make_request("hi", logit_bias={i: 1.0 for i in range(1025)}), "sampling.logit_bias"),
]


@pytest.mark.parametrize(("request_msg", "field"), BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
async def test_bad_request_is_invalid_argument(stack, request_msg, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call_generate(stack["gateway"].addr, request_msg)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


async def test_service_keeps_serving_after_bad_input(stack) -> None:
    responses = await call_generate(stack["gateway"].addr, client.make_request("hello", max_new_tokens=4,
                                                                               ignore_eos=True))
    assert sum(len(r.token_ids) for r in responses) == 4


@pytest.mark.parametrize("where", ["request", "sampling", "messages[0]"])
async def test_unknown_fields_are_refused(stack, where: str) -> None:
    """A field this server does not know (a newer client's) would be dropped silently: INVALID_ARGUMENT naming it."""
    unknown = bytes([0xF8, 0x06, 0x01])     # field 111, varint 1
    if where == "request":
        raw = client.make_request("hello", max_new_tokens=3).SerializeToString() + unknown
    elif where == "sampling":
        sampling = common_pb2.SamplingParams(temperature=1.0).SerializeToString() + unknown
        raw = generate_pb2.GenerateRequest(prompt="hello").SerializeToString()
        raw += bytes([0x1A, len(sampling)]) + sampling                   # field 3 (sampling), length-delimited
    else:
        message = generate_pb2.ChatMessage(role="user", content="hi").SerializeToString() + unknown
        raw = bytes([0x12, len(message)]) + message                      # field 2 (messages)
    async with grpc.aio.insecure_channel(stack["gateway"].addr) as channel:
        call = channel.unary_stream("/specmesh.v1.Generation/Generate", request_serializer=lambda b: b,
                                    response_deserializer=generate_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in call(raw, timeout=60)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{where} has field number 111" in info.value.details()


async def test_internal_services_validate(stack) -> None:
    async with grpc.aio.insecure_channel(stack["verifier"].addr) as channel:
        verifier = verifier_pb2_grpc.VerifierStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await verifier.Verify(verifier_pb2.VerifyRequest(session_id="nope", draft_token_ids=[1]))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED      # not open: same answer as a wrong token
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await verifier.StartSession(verifier_pb2.StartSessionRequest(session_id="s", prompt_token_ids=[10**6]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocab" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await verifier.StartSession(verifier_pb2.StartSessionRequest(session_id="s", prompt_token_ids=[1] * 300))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        start = await verifier.StartSession(verifier_pb2.StartSessionRequest(session_id="ok", prompt_token_ids=[5]))
        assert start.first_token_id >= 0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            bad_q = common_pb2.SparseDist(token_ids=[1, 2], probs=[0.5])
            await verifier.Verify(verifier_pb2.VerifyRequest(session_id="ok", draft_token_ids=[1], draft_dists=[bad_q],
                                                             owner_token=start.owner_token))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft_dists[0]" in info.value.details()
        await verifier.EndSession(common_pb2.EndSessionRequest(session_id="ok", owner_token=start.owner_token))
    async with grpc.aio.insecure_channel(stack["draft"].addr) as channel:
        draft = draft_pb2_grpc.DraftStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await draft.Propose(draft_pb2.ProposeRequest(session_id="d", context_len=5, new_token_ids=[1],
                                                         num_draft_tokens=2, owner_token="t"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND      # unknown session must be sent its whole context


@pytest.mark.parametrize("which", ["gateway", "verifier", "draft"])
async def test_health_and_reflection(stack, which: str) -> None:
    async with grpc.aio.insecure_channel(stack[which].addr) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name async for r in responses for s in r.list_services_response.service}
    expected = {"gateway": "specmesh.v1.Generation", "verifier": "specmesh.v1.Verifier", "draft": "specmesh.v1.Draft"}
    assert {expected[which], "grpc.health.v1.Health"} <= names
