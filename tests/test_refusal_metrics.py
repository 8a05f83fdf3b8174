"""Refusals made before the gateway's servicer runs (API key checks, undecodable request bytes) count in the same
error metric (`specmesh_request_errors_total{code}`) as the servicer's own refusals and the HTTP API's."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio

from gateway.server import build_gateway_parts
from protos.specmesh.v1 import generate_pb2_grpc
from specmesh.config import GatewayConfig
from specmesh.ops import client
from tests.stack import start_verifier

GENERATE = "/specmesh.v1.Generation/Generate"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway():
    verifier = await start_verifier()
    parts = await build_gateway_parts(GatewayConfig(port=0, verifier_addr=verifier.addr, draft_addr="",
                                                    api_keys="key-a:acme"), wait_for_verifier_s=30)
    port = await parts.server.start("127.0.0.1", 0)
    yield {"addr": f"127.0.0.1:{port}", "metrics": parts.metrics}
    await parts.server.stop(0)
    await verifier.stop()


def errors(metrics, code: str) -> float:
    return metrics.registry.get_sample_value("specmesh_request_errors_total", {"code": code}) or 0.0


async def call_generate(addr: str, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(addr) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(client.make_request("Hi", max_new_tokens=2),
                                                                  metadata=metadata, timeout=60)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(("metadata", "code"), [
    ([], "UNAUTHENTICATED"),
    ([("authorization", "Bearer nope")], "PERMISSION_DENIED"),
    ([("authorization", "Bearer key-a"), ("x-specmesh-tenant", "beta")], "PERMISSION_DENIED"),
])
async def test_api_key_refusals_are_counted(gateway, metadata, code) -> None:
    before = errors(gateway["metrics"], code)
    assert (await call_generate(gateway["addr"], metadata)).name == code
    assert errors(gateway["metrics"], code) == before + 1


async def test_undecodable_requests_are_counted(gateway) -> None:
    before = errors(gateway["metrics"], "INVALID_ARGUMENT")
    async with grpc.aio.insecure_channel(gateway["addr"]) as channel:
        call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call(b"\x0a\x02\xff\xfe", metadata=[("authorization", "Bearer key-a")], timeout=30):
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert errors(gateway["metrics"], "INVALID_ARGUMENT") == before + 1
    assert await call_generate(gateway["addr"], [("authorization", "Bearer key-a")]) == grpc.StatusCode.OK
