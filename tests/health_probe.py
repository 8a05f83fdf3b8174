"""grpc.health.v1 probes for tests: a server's overall status, and waiting until it has one."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def health_status(addr: str) -> int:
    """The server's overall status (service "")."""
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)).status


async def until_status(addr: str, expected: int, timeout_s: float = 10.0) -> None:
    """Returns as soon as the server reports `expected` (polled every 20 ms); AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while await health_status(addr) != expected:
        assert time.monotonic() < deadline, f"health never {expected}"
        await asyncio.sleep(0.02)
