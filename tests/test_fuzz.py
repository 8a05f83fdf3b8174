"""Hypothesis-generated requests against the gateway: no crash, every error documented, service keeps serving."""

from __future__ import annotations

import grpc
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.specmesh.v1 import common_pb2, generate_pb2
from tests.stack import start_gateway, start_verifier

METHOD = "/specmesh.v1.Generation/Generate"
# Documented outcomes: OK, or INVALID_ARGUMENT for anything malformed. RESOURCE_EXHAUSTED covers a message over the
# 16 MiB limit (not generated here).
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT}

text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=()), max_size=40)
numbers = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, -1, 2**32, 2**64 - 1]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, -1.0, 1.0, 2.0]))


@st.composite
def requests(draw) -> bytes:
    sampling = common_pb2.SamplingParams(temperature=draw(floats), top_p=draw(floats),
                                         top_k=draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(0, 2**64 - 1))
    request = generate_pb2.GenerateRequest(
        prompt=draw(text), sampling=sampling, max_new_tokens=draw(st.integers(0, 2**32 - 1)) % 12 or 0,
        stop=draw(st.lists(text, max_size=4)), ignore_eos=draw(st.booleans()), request_id=draw(text))
    if draw(st.booleans()):
        request.messages.add(role=draw(st.sampled_from(["user", "system", "bot", ""])), content=draw(text))
    if draw(st.booleans()):
        request.num_draft_tokens = draw(st.integers(0, 2**32 - 1)) % 40
    return request.SerializeToString()


raw_bytes = st.binary(max_size=200)
invalid_utf8 = st.just(bytes([0x0A, 0x03, 0xFF, 0xFE, 0xC3]))      # prompt = 3 bytes of invalid UTF-8


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway():
    verifier = await start_verifier(max_model_len=128, decode_ahead_tokens=8)
    gw = await start_gateway(verifier.addr, "")
    yield gw
    for running in (gw, verifier):
        await running.stop()


async def call_raw(addr: str, payload: bytes) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(addr) as channel:
        call = channel.unary_stream(METHOD, request_serializer=lambda b: b,
                                    response_deserializer=generate_pb2.GenerateResponse.FromString)
        try:
            async for _ in call(payload, timeout=60):
                pass
        except grpc.aio.AioRpcError as exc:
            assert exc.details(), "every error carries a message"
            return exc.code()
    return grpc.StatusCode.OK


async def test_fuzzed_requests_never_crash(gateway) -> None:
    seen: list[grpc.StatusCode] = []

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payload=st.one_of(requests(), raw_bytes, invalid_utf8))
    def collect(payload: bytes) -> None:
        payloads.append(payload)

    payloads: list[bytes] = []
    collect()
    for payload in payloads:
        code = await call_raw(gateway.addr, payload)
        assert code == grpc.StatusCode.OK or code in ALLOWED, (code, payload)
        seen.append(code)
    assert grpc.StatusCode.INVALID_ARGUMENT in seen
    ok = generate_pb2.GenerateRequest(prompt="still serving", max_new_tokens=3, ignore_eos=True)
    assert await call_raw(gateway.addr, ok.SerializeToString()) == grpc.StatusCode.OK


async def test_undecodable_bytes_are_invalid_argument(gateway) -> None:
    assert await call_raw(gateway.addr, bytes([0x0A, 0x03, 0xFF, 0xFE, 0xC3])) == grpc.StatusCode.INVALID_ARGUMENT
    assert await call_raw(gateway.addr, b"\xff\xff\xff\xff") == grpc.StatusCode.INVALID_ARGUMENT


async def test_oversize_message_is_rejected_cleanly(gateway) -> None:
    huge = generate_pb2.GenerateRequest(prompt="x" * (17 * 2**20)).SerializeToString()
    assert await call_raw(gateway.addr, huge) == grpc.StatusCode.RESOURCE_EXHAUSTED
    ok = generate_pb2.GenerateRequest(prompt="fine", max_new_tokens=2, ignore_eos=True)
    assert await call_raw(gateway.addr, ok.SerializeToString()) == grpc.StatusCode.OK
