"""Internal channels (gateway/channels.py): a new channel to a service restarted on the same address reaches it at
once, whatever happened to earlier channels to that address in the same process."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.channels import internal_channel


async def health_server(port: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


async def check(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    return int(reply.status)


async def test_a_new_channel_to_a_restarted_service_does_not_inherit_the_dead_connection_s_backoff() -> None:
    """gRPC shares connections across channels to one address by default: a channel made after the service came back
    on its old port inherited the reconnect backoff of a channel that saw it die, and its first calls failed with
    "Connection refused" while the service was serving (a replica found again; a gateway test's draft service on a
    port an earlier test's had used)."""
    server, port = await health_server(0)
    addr = f"127.0.0.1:{port}"
    old = internal_channel(addr)
    try:
        assert await check(old) == health_pb2.HealthCheckResponse.SERVING
        await server.stop(None)
        try:
            await check(old)                                     # sees the service gone: backoff starts
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
        server, _ = await health_server(port)                    # back on the same address
        fresh = internal_channel(addr)
        try:
            assert await check(fresh) == health_pb2.HealthCheckResponse.SERVING
        finally:
            await fresh.close()
    finally:
        await old.close()
        await server.stop(None)
