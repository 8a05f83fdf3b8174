"""A verifier replica's own warm-up (SPECMESH_VERIFIER_WARMUP_TOKENS): health says SERVING only after a greedy session
ran through its engine and ended with its KV blocks free (the mechanism, ServiceServer.warm_up:
tests/test_server_warm_up.py)."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.config import EngineConfig, VerifierConfig
from specmesh.spec.sampling import SamplingParams
from verifier_service.server import build_verifier
from verifier_service.warmup import WARMUP_SESSION_ID

SERVING = health_pb2.HealthCheckResponse.SERVING


async def _status(addr: str) -> int:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)).status


async def test_a_replica_reports_serving_only_after_its_warm_up_session() -> None:
    config = VerifierConfig(port=0, warmup_tokens=8,
                            engine=EngineConfig(model="tiny-target", kv_cache_memory_mb=16, dtype="float32"))
    server, engine = build_verifier(config)
    try:
        addr = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
        deadline = time.monotonic() + 60
        while await _status(addr) != SERVING:
            assert time.monotonic() < deadline, "never SERVING"
            await asyncio.sleep(0.02)
        # the moment it says SERVING: the warm-up prefilled and verified (undrafted and drafted rows), and ended
        assert engine.num_steps >= 3
        assert WARMUP_SESSION_ID not in engine.sessions and engine.block_manager.num_used_blocks == 0
        result = await engine.start_session("client", [5, 6, 7, 8], SamplingParams(), max_new_tokens=4).future
        assert len(result.token_ids) == 1
        engine.end_session("client")
    finally:
        await server.stop()

