"""gRPC server bootstrap shared by the services: health, reflection, message limits, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 2**20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


class ServiceServer:
    """An aio server with `grpc.health.v1` and server reflection for the given services."""

    def __init__(self, service_names: Sequence[str], add_servicers: Callable[[grpc.aio.Server], None]) -> None:
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        add_servicers(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise RuntimeError(f"cannot bind {host}:{port}")
        await self.server.start()
        await self._set_status(health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def _set_status(self, status: int) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Report NOT_SERVING, refuse new calls, let running ones finish within grace_s."""
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)


async def serve_until_signal(server: ServiceServer, host: str, port: int, on_stop: Callable[[], None],
                             grace_s: float = 10.0) -> None:
    bound = await server.start(host, port)
    log.info("serving %s on %s:%d", ", ".join(server.service_names), host, bound)
    print(f"ready: {', '.join(server.service_names)} on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining (up to %.0f s)", grace_s)
    await server.stop(grace_s)
    on_stop()


def status_code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)
