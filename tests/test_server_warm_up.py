"""ServiceServer.warm_up, shared by the gateway's and a verifier replica's own warm-ups: health reports NOT_SERVING
until the warm-up has ended, whatever the readiness watch says meanwhile; then the watch alone decides; a warm-up
that fails still opens the service; without one the watch decides from the start."""

from __future__ import annotations

import asyncio

from specmesh.rpc.grpc_server import ServiceServer
from tests.health_probe import NOT_SERVING, SERVING
from tests.health_probe import health_status as _status
from tests.health_probe import until_status as _until_status


def _server() -> ServiceServer:
    return ServiceServer(["specmesh.test.Nothing"], lambda server: None)


async def test_the_watch_opens_the_service_only_after_its_warm_up() -> None:
    server, release = _server(), asyncio.Event()

    async def warm_up() -> str:
        await release.wait()
        return "warmed up"

    server.warm_up = warm_up
    addr = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
    try:
        assert await _status(addr) == NOT_SERVING
        await server.set_ready(True)                    # the watch says ready; the warm-up is still running
        assert await _status(addr) == NOT_SERVING
        release.set()
        await _until_status(addr, SERVING)
        await server.set_ready(False)                   # after it, only the watch decides
        assert await _status(addr) == NOT_SERVING
    finally:
        await server.stop(0)


async def test_a_failed_warm_up_still_opens_the_service_as_the_watch_says() -> None:
    server, watch_ready = _server(), [False]
    server.readiness = lambda: watch_ready[0]

    async def warm_up() -> str:
        await asyncio.sleep(0.1)
        watch_ready[0] = True                           # a verifier answered meanwhile
        raise RuntimeError("no KV blocks")

    server.warm_up = warm_up
    addr = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
    try:
        await _until_status(addr, SERVING)
    finally:
        await server.stop(0)


async def test_without_a_warm_up_the_watch_alone_decides() -> None:
    server = _server()
    addr = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
    try:
        assert await _status(addr) == SERVING
        await server.set_ready(False)
        assert await _status(addr) == NOT_SERVING
    finally:
        await server.stop(0)
