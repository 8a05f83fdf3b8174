"""The gateway's own warm-up (SPECMESH_GATEWAY_WARMUP_TOKENS): health says SERVING only after one generation ran
through the gateway itself, with its own API key where it wants one; a warm-up that fails still opens the gateway."""

from __future__ import annotations

import asyncio
import time

from grpc_health.v1 import health_pb2

from gateway.server import build_gateway_parts
from gateway.warmup_gate import WarmupGate
from specmesh.config import GatewayConfig
from tests.stack import start_verifier
from tests.test_health import grpc_health

SERVING = health_pb2.HealthCheckResponse.SERVING


def _sample(registry, name: str) -> float:  # noqa: ANN001 - a prometheus CollectorRegistry
    return sum(s.value for m in registry.collect() for s in m.samples if s.name == name)


async def test_the_gateway_reports_serving_only_after_its_warm_up() -> None:
    verifier = await start_verifier()
    config = GatewayConfig(port=0, verifier_addr=verifier.addr, draft_addr="", warmup_tokens=6, api_keys="k1:team",
                           enable_cache=False)
    gateway = await build_gateway_parts(config, wait_for_verifier_s=30)
    registry = gateway.metrics.registry
    try:
        addr = f"127.0.0.1:{await gateway.server.start('127.0.0.1', 0)}"
        deadline = time.monotonic() + 60
        while await grpc_health(addr) != [SERVING, SERVING]:
            assert _sample(registry, "specmesh_generation_tokens_total") < 6, "warmed up but not SERVING"
            assert time.monotonic() < deadline, "never SERVING"
            await asyncio.sleep(0.02)
        # the moment it says SERVING, its warm-up generation (with the gateway's own key) has finished
        assert _sample(registry, "specmesh_generation_tokens_total") == 6
        assert _sample(registry, "specmesh_requests_total") == 1
        assert _sample(registry, "specmesh_request_errors_total") == 0
    finally:
        await gateway.server.stop()
        await verifier.stop()


class _Server:
    def __init__(self) -> None:
        self.ready: list[bool] = []

    async def set_ready(self, ready: bool) -> None:
        self.ready.append(ready)


async def test_a_failed_warm_up_still_opens_the_gateway_and_the_watch_decides_before() -> None:
    server = _Server()
    gate = WarmupGate(server, num_tokens=4)          # type: ignore[arg-type] - the one method the gate calls
    await gate.set_ready(True)                       # a verifier answers, the warm-up has not run: still closed
    assert server.ready == [False] and not gate.ready(True)
    # nothing listens there: the warm-up fails at once, is logged, and the gateway opens anyway
    await gate.run("unix:/nonexistent/specmesh-warmup.sock", lambda: True, timeout_s=5.0)
    assert server.ready == [False, True] and gate.done
    await gate.set_ready(False)                      # then only the watch decides
    assert server.ready[-1] is False and gate.ready(True)


async def test_without_a_warm_up_the_watch_alone_decides() -> None:
    server = _Server()
    gate = WarmupGate(server, num_tokens=0)          # type: ignore[arg-type]
    await gate.set_ready(True)
    assert server.ready == [True] and gate.done
