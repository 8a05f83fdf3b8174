"""The gateway's own warm-up (SPECMESH_GATEWAY_WARMUP_TOKENS): health says SERVING only after its warm-up
generations (one greedy, one sampled) ran through the gateway itself, with its own API key where it wants one (the
mechanism, ServiceServer.warm_up: tests/test_server_warm_up.py)."""

from __future__ import annotations

import asyncio
import time

from grpc_health.v1 import health_pb2

from gateway.server import build_gateway_parts
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
        # No check of the counter while NOT_SERVING: the warm-up counts its tokens just before the gateway flips to
        # SERVING, so a poll can see NOT_SERVING and then the full count (the race that once failed CI).
        while await grpc_health(addr) != [SERVING, SERVING]:
            assert time.monotonic() < deadline, "never SERVING"
            await asyncio.sleep(0.02)
        # the moment it says SERVING, its warm-up generations (greedy and sampled, with the gateway's own key) have
        # finished
        assert _sample(registry, "specmesh_generation_tokens_total") == 12
        assert _sample(registry, "specmesh_requests_total") == 2
        assert _sample(registry, "specmesh_request_errors_total") == 0
    finally:
        await gateway.server.stop()
        await verifier.stop()

