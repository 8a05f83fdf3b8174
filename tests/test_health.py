"""The gateway's health tells the truth: NOT_SERVING (gRPC health for "" and the Generation service, HTTP /health
503) while no verifier replica answers, SERVING again once one does."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.health import VerifierWatch
from gateway.openai_http import ServedModel, start_openai_http
from gateway.replicas import VerifierPool
from gateway.server import SERVICE_NAME
from protos.specmesh.v1 import verifier_pb2
from specmesh.config import EngineConfig, VerifierConfig
from tests.stack import Running, start_gateway, start_verifier
from verifier_service.server import build_verifier

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def grpc_health(addr: str) -> list[int]:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return [(await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
                for name in ("", SERVICE_NAME)]


async def http_health(port: int) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/health") as response:
        assert response.content_type == "application/json"
        return response.status


async def wait_for(check, expected: object, within_s: float) -> float:
    start = time.monotonic()
    while (got := await check()) != expected:
        assert time.monotonic() - start < within_s, f"still {got} after {within_s:.0f} s (expected {expected})"
        await asyncio.sleep(0.2)
    return time.monotonic() - start


async def restart_verifier(port: int) -> Running:
    config = VerifierConfig(port=port, engine=EngineConfig(model="tiny-target", kv_cache_memory_mb=16))
    server, engine = build_verifier(config)
    return Running(server, await server.start("127.0.0.1", port), engine)


async def test_health_follows_the_verifier() -> None:
    verifier = await start_verifier()
    gateway = await start_gateway(verifier.addr, "")
    http = await start_openai_http(ServedModel("tiny-target", 2048, 0), "127.0.0.1", 0, lambda: gateway.addr)
    try:
        assert await grpc_health(gateway.addr) == [SERVING, SERVING]
        assert await http_health(http.port) == 200
        await verifier.stop()
        down_s = await wait_for(lambda: grpc_health(gateway.addr), [NOT_SERVING, NOT_SERVING], within_s=15)
        assert await http_health(http.port) == 503
        verifier = await restart_verifier(verifier.port)                 # the same address again
        up_s = await wait_for(lambda: grpc_health(gateway.addr), [SERVING, SERVING], within_s=20)
        assert await http_health(http.port) == 200
        print(f"NOT_SERVING {down_s:.1f} s after the verifier stopped, SERVING {up_s:.1f} s after it restarted")
    finally:
        await http.close()
        await gateway.stop()
        await verifier.stop()


class FakeVerifier:
    def __init__(self) -> None:
        self.up = True

    async def GetModelInfo(self, request: object, timeout: float) -> object:  # noqa: N802 (gRPC method name)
        if not self.up:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "connection refused")
        return verifier_pb2.ModelInfo()


@pytest.mark.parametrize("failures_to_down", [1, 2])
async def test_watch_needs_every_replica_down_and_consecutive_failures(failures_to_down: int) -> None:
    changes: list[bool] = []

    async def record(serving: bool) -> None:
        changes.append(serving)

    replicas = [FakeVerifier(), FakeVerifier()]
    pool = VerifierPool.of_stubs(replicas)  # type: ignore[arg-type]
    watch = VerifierWatch(pool, record, failures_to_down=failures_to_down)
    replicas[0].up = False
    for _ in range(3):
        assert await watch.probe_once() is True              # one replica still answers
    replicas[1].up = False
    for _ in range(failures_to_down - 1):
        assert await watch.probe_once() is True              # not down on fewer failures than the threshold
    assert await watch.probe_once() is False
    assert await watch.probe_once() is False
    replicas[1].up = True
    assert await watch.probe_once() is True                  # one answer is enough to serve again
    assert changes == [False, True]


class FakeChannel:
    closed = False

    async def close(self) -> None:
        self.closed = True


async def test_a_removed_replica_is_probed_while_sessions_are_pinned_to_it() -> None:
    async def ignore(serving: bool) -> None:
        pass

    fakes = {"a": FakeVerifier(), "b": FakeVerifier()}
    channels = {"a": FakeChannel(), "b": FakeChannel()}
    pool = VerifierPool(lambda addr: (fakes[addr], channels[addr]), ["a", "b"])  # type: ignore[arg-type,return-value]
    watch = VerifierWatch(pool, ignore, failures_to_down=1)
    replica = pool.replicas["a"]
    replica.num_opened = 1                                   # a session pinned to it
    pool.set_addrs(["b"])                                    # a left discovery: no new sessions there
    assert [r.addr for r in pool.order([1, 2])] == ["b"] and not channels["a"].closed
    fakes["a"].up = False
    await watch.probe_once()
    assert replica.lost.is_set()                             # it froze: its waiting Verify moves
    replica.release()                                        # the session moved; nothing is pinned to it now
    await asyncio.sleep(0)
    assert channels["a"].closed and pool.probed() == [pool.replicas["b"]]
