"""specmesh/rpc/rpc_guard.py on a real ServiceServer: EngineError -> its status, anything else -> INTERNAL with a logged
traceback (never UNKNOWN), for unary and server-streaming methods; undecodable bytes -> INVALID_ARGUMENT."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from google.protobuf import wrappers_pb2

from specmesh.engine.loop import EngineError
from specmesh.rpc.grpc_server import ServiceServer

SERVICE = "test.Guarded"


def _raise(kind: str) -> None:
    if kind == "engine":
        raise EngineError("RESOURCE_EXHAUSTED", "queue is full")
    if kind == "bug":
        raise KeyError("a bug")


async def unary(request: wrappers_pb2.StringValue, context: grpc.aio.ServicerContext) -> wrappers_pb2.StringValue:
    _raise(request.value)
    return wrappers_pb2.StringValue(value="ok:" + request.value)


async def stream(request: wrappers_pb2.StringValue,
                 context: grpc.aio.ServicerContext) -> AsyncIterator[wrappers_pb2.StringValue]:
    yield wrappers_pb2.StringValue(value="first")
    _raise(request.value)
    yield wrappers_pb2.StringValue(value="ok:" + request.value)


def add_guarded(server: grpc.aio.Server) -> None:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, wrappers_pb2.StringValue.FromString,
                                                     wrappers_pb2.StringValue.SerializeToString),
        "Stream": grpc.unary_stream_rpc_method_handler(stream, wrappers_pb2.StringValue.FromString,
                                                       wrappers_pb2.StringValue.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def addr():
    server = ServiceServer([SERVICE], add_guarded)
    port = await server.start("127.0.0.1", 0)
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def call(addr: str, method: str, payload: bytes) -> tuple[grpc.StatusCode, str, list[bytes]]:
    received: list[bytes] = []
    async with grpc.aio.insecure_channel(addr) as channel:
        try:
            if method == "Unary":
                received.append(await channel.unary_unary(f"/{SERVICE}/Unary")(payload, timeout=10))
            else:
                async for item in channel.unary_stream(f"/{SERVICE}/Stream")(payload, timeout=10):
                    received.append(item)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or "", received
    return grpc.StatusCode.OK, "", received


def value(text: str) -> bytes:
    return wrappers_pb2.StringValue(value=text).SerializeToString()


@pytest.mark.parametrize("method", ["Unary", "Stream"])
async def test_errors_map_to_status_codes(addr: str, method: str, caplog: pytest.LogCaptureFixture) -> None:
    code, _, received = await call(addr, method, value("fine"))
    assert code == grpc.StatusCode.OK and received[-1] == value("ok:fine")
    code, details, _ = await call(addr, method, value("engine"))
    assert (code, details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full")
    with caplog.at_level(logging.ERROR, logger="specmesh.rpc.rpc_guard"):
        code, details, received = await call(addr, method, value("bug"))
    assert code == grpc.StatusCode.INTERNAL and "KeyError" in details
    assert any(r.exc_info and r.exc_info[0] is KeyError and method in r.getMessage() for r in caplog.records)
    if method == "Stream":
        assert received == [value("first")]          # what was streamed before the failure still arrived


@pytest.mark.parametrize("method", ["Unary", "Stream"])
async def test_undecodable_bytes_name_the_message_type(addr: str, method: str) -> None:
    code, details, _ = await call(addr, method, bytes([0x0A, 0x02, 0xC3, 0x28]))     # value = invalid UTF-8
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "google.protobuf.StringValue" in details
