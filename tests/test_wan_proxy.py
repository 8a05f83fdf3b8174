"""WAN proxy: gRPC works through it, round trips pay the configured RTT, bytes arrive intact and in order,
and the bandwidth limit holds."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.wan_proxy import TokenBucket, WanProxy
from tests.redis_server import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def start_health_server() -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port


async def timed_checks(addr: str, n: int) -> list[float]:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)   # connect + HTTP/2 handshake
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            times.append(time.perf_counter() - t0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        return times


async def test_grpc_health_check_pays_the_rtt() -> None:
    server, port = await start_health_server()
    try:
        direct = await timed_checks(f"127.0.0.1:{port}", 3)
        async with WanProxy(0, f"127.0.0.1:{port}", latency_ms=30) as proxy:
            proxied = await timed_checks(proxy.address, 5)
            assert proxy.stats.connections == 1
            assert proxy.stats.bytes_up > 0 and proxy.stats.bytes_down > 0
            proxy.latency_ms = 5    # changeable while running
            faster = await timed_checks(proxy.address, 3)
    finally:
        await server.stop(None)
    assert min(direct) < 0.06, direct
    assert min(proxied) >= 0.060, proxied           # RTT = 2 x 30 ms one-way
    assert min(proxied) < 0.060 + 0.5, proxied     # ... and not wildly more
    assert 0.010 <= min(faster) < 0.060, faster


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def send_and_collect(addr: str, payload: bytes) -> tuple[bytes, float, float]:
    """Send payload in odd-sized pieces, half-close, read the echo; returns (echo, first byte s, total s)."""
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.perf_counter()

    async def send() -> None:
        for i in range(0, len(payload), 7001):
            writer.write(payload[i:i + 7001])
            await writer.drain()
        writer.write_eof()

    sender = asyncio.create_task(send())
    received = bytearray()
    first = 0.0
    while data := await reader.read(65536):
        first = first or time.perf_counter() - t0
        received += data
    await sender
    writer.close()
    return bytes(received), first, time.perf_counter() - t0


async def test_echo_bytes_intact_with_latency_and_bandwidth() -> None:
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    payload = os.urandom(600_000)
    rate = 2_000_000   # bytes/s per direction
    try:
        async with WanProxy(0, target, latency_ms=20, bandwidth_bps=rate) as proxy:
            received, first, total = await send_and_collect(proxy.address, payload)
            assert proxy.stats.bytes_up == proxy.stats.bytes_down == len(payload)
    finally:
        server.close()
        await server.wait_closed()
    assert received == payload
    assert first >= 0.040, first                         # one round trip before the first echoed byte
    assert total >= len(payload) / rate, total           # 0.3 s of serialization at 2 MB/s
    assert total < len(payload) / rate + 2.0, total


def test_token_bucket_serializes_at_rate() -> None:
    bucket = TokenBucket(1000.0, burst_bytes=100)
    assert bucket.reserve(100, now=0.0) == 0.0           # the burst goes out at once
    assert bucket.reserve(500, now=0.0) == 0.5           # then 500 bytes at 1000 B/s
    assert bucket.reserve(100, now=0.5) == 0.6           # still busy: queued behind
    assert bucket.reserve(50, now=10.0) == 10.0          # idle refills (up to the burst)
    assert TokenBucket(0, 1).reserve(10**9, now=3.0) == 3.0   # 0 = unlimited


async def test_cli_forwards() -> None:
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    listen_port = free_port()          # (a port from the pid had met a socket already bound there)
    proc = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "bench", "wan_proxy.py"),
                             "--listen", f"127.0.0.1:{listen_port}", "--target", target, "--rtt-ms", "40",
                             "--bandwidth-mbps", "10"], stdout=subprocess.PIPE, text=True)
    try:
        banner = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert "rtt=40.0ms" in banner
        payload = os.urandom(50_000)
        received, first, _ = await send_and_collect(f"127.0.0.1:{listen_port}", payload)
        assert received == payload
        assert first >= 0.040
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()
        server.close()
        await server.wait_closed()
