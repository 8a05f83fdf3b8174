"""The gateway's own warm-up (`SPECMESH_GATEWAY_WARMUP_TOKENS` > 0): one greedy generation through its own gRPC server
(a plaintext unix-socket loopback, as the HTTP API's) before health reports SERVING, so a readiness probe
(docker-compose's healthcheck, a Kubernetes readinessProbe) sends clients only to a warm gateway
(specmesh/ops/warmup.py says what a fresh stack's first request pays).

Health is SERVING when some verifier replica answers (gateway/health.py's VerifierWatch) and the warm-up is over,
however it ended: a failed warm-up (no verifier yet after `wait_s`, an error) is logged and the gateway serves as
it would have without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from specmesh.ops.warmup import warm_up_async
from specmesh.rpc.grpc_server import ServiceServer

log = logging.getLogger(__name__)


class WarmupGate:
    def __init__(self, server: ServiceServer, num_tokens: int, api_key: str = "") -> None:
        self.server = server
        self.num_tokens = num_tokens
        self.api_key = api_key                # the gateway's own first key, where it wants one
        self.done = num_tokens <= 0
        self.serving = False                  # the verifier watch's last word

    def ready(self, serving: bool) -> bool:
        return serving and self.done

    async def set_ready(self, serving: bool) -> None:
        """The verifier watch's callback: SERVING only once the warm-up is over."""
        self.serving = serving
        await self.server.set_ready(self.ready(serving))

    async def run(self, target: str, verifier_serving: Callable[[], bool], wait_s: float = 120.0,
                  timeout_s: float = 300.0) -> None:
        """Waits (up to wait_s) for a verifier replica to answer, warms up through `target`, then opens."""
        deadline = time.monotonic() + wait_s
        while not verifier_serving() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        try:
            log.info("%s", await warm_up_async(target, self.num_tokens, timeout_s, self.api_key))
        finally:
            self.done = True
            await self.server.set_ready(self.ready(verifier_serving()))
