"""The gateway's readiness: it can serve while at least one verifier replica answers.

A small watcher probes every replica of the pool (gateway/replicas.py: the discovered set, as it is now) with
GetModelInfo (timeout `timeout_s`), pausing `interval_s` between rounds of probes, on the same channels the requests
use, and reports each change of "some replica answers" to `on_change` (the gateway's gRPC health, which the HTTP
API's /health reads too). A replica counts as down after `failures_to_down` failed probes in a row (one slow answer
on a loaded machine does not flap the health) and as up again after one answered probe. So a verifier that hangs is
reported NOT_SERVING at most `failures_to_down * (interval_s + timeout_s)` after its last answer (`down_within_s`:
6 s with the defaults 1 s, 2 s, 2) and SERVING again at most `interval_s + timeout_s` after it answers again. A
replica marked down moves the streams whose Verify waits on it (gateway/verifier_session.py); each answer also
refreshes the replica's load and draining state for placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc

from gateway.replicas import Replica, VerifierPool
from protos.specmesh.v1 import verifier_pb2

log = logging.getLogger(__name__)


class VerifierWatch:
    def __init__(self, pool: VerifierPool, on_change: Callable[[bool], Awaitable[None]], interval_s: float = 1.0,
                 timeout_s: float = 2.0, failures_to_down: int = 2,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.pool = pool
        self.on_change = on_change
        self.interval_s, self.timeout_s, self.failures_to_down = interval_s, timeout_s, failures_to_down
        self.sleep = sleep                             # injectable: tests run the timing on a virtual clock
        self.failures: dict[str, int] = {}             # consecutive failed probes per replica address
        self.serving = True                            # the gateway was built after a verifier answered
        self._task: asyncio.Task[None] | None = None

    @property
    def down_within_s(self) -> float:
        """Longest time from a replica's last answer to NOT_SERVING (it hangs just after answering a probe)."""
        return self.failures_to_down * (self.interval_s + self.timeout_s)

    async def _probe(self, replica: Replica) -> None:
        try:
            info = await replica.stub.GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            failures = self.failures[replica.addr] = self.failures.get(replica.addr, 0) + 1
            if failures == self.failures_to_down:
                log.warning("verifier %s does not answer: %s", replica.addr, exc.code().name)
                replica.set_up(False)
            return
        if not replica.up:
            log.info("verifier %s answers again", replica.addr)
        self.failures[replica.addr] = 0
        replica.set_up(True)
        replica.report(info)

    async def probe_once(self) -> bool:
        """Probes every replica once; reports a change of the gateway's readiness. Returns it."""
        replicas = self.pool.probed()
        await asyncio.gather(*(self._probe(r) for r in replicas))
        self.failures = {r.addr: self.failures.get(r.addr, 0) for r in self.pool.probed()}   # forget gone ones
        serving = any(r.usable for r in self.pool.all())
        if serving != self.serving:
            self.serving = serving
            log.warning("gateway %s", "SERVING: a verifier answers" if serving else
                        "NOT_SERVING: no verifier replica answers")
            await self.on_change(serving)
        return serving

    async def _run(self) -> None:
        while True:
            await self.sleep(self.interval_s)
            try:
                await self.probe_once()
            except Exception:                  # never let the watcher die silently
                log.exception("verifier health probe failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="verifier-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
