"""gRPC server bootstrap shared by the services: health, reflection, message limits, request parsing and error
mapping (specmesh/rpc/rpc_guard.py), background tasks, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specmesh.rpc.heap import freeze_start_up_heap
from specmesh.rpc.rpc_guard import RefusalHook, RpcGuard, status_code
from specmesh.telemetry.metrics import MetricsServer
from specmesh.telemetry.tracing import server_interceptors

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 2**20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Connections are recycled (GOAWAY, then the client reconnects) every ~5 min (gRPC adds +-10% jitter), so a
    # client behind a ClusterIP Service or load balancer spreads over replicas added since it connected. Calls in
    # flight get 10 min to finish (a long stream is not cut); sessions live in the engine, not the connection.
    ("grpc.max_connection_age_ms", 300_000),
    ("grpc.max_connection_age_grace_ms", 600_000),
]


class ServiceServer:
    """An aio server with `grpc.health.v1` and server reflection for the given services."""

    def __init__(self, service_names: Sequence[str], add_servicers: Callable[[grpc.aio.Server], None],
                 credentials: grpc.ServerCredentials | None = None,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 on_refused: RefusalHook | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        # RpcGuard innermost: it sees the servicer's own exceptions; the others see the status it sets.
        options = [(name, max_message_bytes if name == "grpc.max_receive_message_length" else value)
                   for name, value in SERVER_OPTIONS]
        self.server = grpc.aio.server(options=options,
                                      interceptors=[*server_interceptors(), *interceptors, RpcGuard(on_refused)])
        self.credentials = credentials              # TLS (specmesh.rpc.security.server_credentials); None = plaintext
        add_servicers(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.port = 0
        self.metrics: MetricsServer | None = None    # this service's /metrics endpoint, closed on stop()
        self.on_stop: list[Callable[[], Awaitable[None]]] = []   # run after the server stopped (flush caches)
        self.stats: dict[str, Callable[[], dict[str, int]]] = {}  # name -> snapshot of plain-int counters
        # Awaited on stop after health turns NOT_SERVING and before new calls are refused: lets in-flight work end
        # (the verifier waits for its sessions, whose Verify calls must still get through).
        self.drain: Callable[[], Awaitable[None]] | None = None
        # Started with the server, cancelled once it has stopped (they keep running while it drains): e.g. the
        # model services' lease reaper (specmesh/rpc/leases.py).
        self.background: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._tasks: list[asyncio.Task[None]] = []
        # When set, health reports SERVING only while it is true (the gateway: some verifier replica answers);
        # whoever watches it calls set_ready() on each change.
        self.readiness: Callable[[], bool] | None = None
        # When set, run once in the background after start(), and health reports SERVING only after it has ended,
        # however it ended (its line or its failure is logged): a service's warm-up (the gateway's generation through
        # itself, a verifier replica's session through its engine), so a readiness probe waits for it.
        self.warm_up: Callable[[], Awaitable[str]] | None = None
        self._warm = True
        self._stopping = False

    async def start(self, host: str, port: int) -> int:
        address = f"{host}:{port}"
        self.port = (self.server.add_secure_port(address, self.credentials) if self.credentials is not None
                     else self.server.add_insecure_port(address))
        if self.port == 0:
            raise RuntimeError(f"cannot bind {host}:{port}")
        await self.server.start()
        self._tasks = [asyncio.ensure_future(make()) for make in self.background]
        if self.warm_up is not None:
            self._warm = False
            self._tasks.append(asyncio.ensure_future(self._warm_up_then_open(self.warm_up)))
        await self.set_ready(self.readiness is None or self.readiness())
        return self.port

    async def _warm_up_then_open(self, warm_up: Callable[[], Awaitable[str]]) -> None:
        try:
            log.info("%s", await warm_up())
        except Exception as exc:  # noqa: BLE001 - any failure: serve as without a warm-up
            log.warning("warm-up failed (%r); serving without it", exc)
        finally:
            self._warm = True
            await self.set_ready(self.readiness is None or self.readiness())

    async def set_ready(self, ready: bool) -> None:
        """SERVING or NOT_SERVING for every service name (NOT_SERVING until a warm-up has ended); ignored before
        start and once stopping."""
        if self.port and not self._stopping:
            await self._set_status(health_pb2.HealthCheckResponse.SERVING if ready and self._warm
                                   else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _set_status(self, status: int) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Report NOT_SERVING, drain, refuse new calls, let running ones finish; all within grace_s."""
        deadline = time.monotonic() + grace_s
        self._stopping = True
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.drain is not None and grace_s > 0:
            try:
                await asyncio.wait_for(self.drain(), grace_s)
            except TimeoutError:
                log.warning("drain did not finish within %.0f s", grace_s)
        await self.server.stop(max(0.0, deadline - time.monotonic()))
        for task in self._tasks:
            task.cancel()
        if self.metrics is not None:
            self.metrics.close()
        for hook in self.on_stop:
            await hook()


async def serve_until_signal(server: ServiceServer, host: str, port: int, on_stop: Callable[[], None],
                             grace_s: float = 10.0) -> None:
    log.info("%s", freeze_start_up_heap())       # a service process, built: its model leaves the collector's walks
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


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The caller's deadline as a time.monotonic() value (None when the caller set none)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


__all__ = ["ServiceServer", "deadline_of", "serve_until_signal", "status_code"]
