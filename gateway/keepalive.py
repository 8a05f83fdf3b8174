"""Backpressure without loss: while a client's stream is open, its sessions' leases are renewed.

A client that reads slowly stops the gateway's rounds (its stream's writes wait on flow control), and a session
with no call for its lease is ended by the service. So from the moment the verifier session starts until the
stream ends, one small task per request sends `KeepAlive` (verifier and, once it holds a session there, the draft
service) every interval: `session_keepalive_s`, or a third of the shortest lease the services reported (the
verifier's StartSessionResponse.lease_s, KeepAliveResponse.lease_s), 20 s while none did. A session thus ends by
lease only when its gateway is gone. What a paused stream holds stays bounded: once its HTTP/2 window is full no
round runs, so the gateway holds what the window let through (at most max_new_tokens of responses) and one round;
the verifier decodes at most decode_ahead_tokens ahead; the KV blocks are the session's own.

A service that does not know KeepAlive (UNIMPLEMENTED: an older one) is not asked again; other failures are logged
at debug level and retried at the next interval (a real loss shows up in the request's next round).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc

from gateway.proposers.draft_model import ModelDrafter
from gateway.proposers.policy import ProposerPolicy
from protos.specmesh.v1 import common_pb2

if TYPE_CHECKING:
    from gateway.round_loop import Generation

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 20.0
MIN_INTERVAL_S = 0.05
POLL_S = 1.0                    # the task wakes at least this often to see whether a renewal is due


def keepalive_interval_s(configured_s: float, leases_s: list[float]) -> float:
    """configured_s > 0 wins; else a third of the shortest known lease; DEFAULT_INTERVAL_S when none is known."""
    if configured_s > 0:
        return configured_s
    known = [lease for lease in leases_s if lease > 0]
    return max(MIN_INTERVAL_S, min(known) / 3) if known else DEFAULT_INTERVAL_S


def model_drafter_of(drafter: object) -> ModelDrafter | None:
    """The draft-service half of a request's drafter (itself, or the model tier behind the cache / n-gram)."""
    if isinstance(drafter, ModelDrafter):
        return drafter
    model = drafter.model if isinstance(drafter, ProposerPolicy) else None
    return model if isinstance(model, ModelDrafter) else None


class SessionKeepAlive:
    """Renews one request's sessions until `stop()` (the generation's verifier stub, session id, owner token, lease
    and drafter are read at each renewal: they change once its StartSession has answered)."""

    def __init__(self, generation: Generation, configured_s: float = 0.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.generation = generation
        self.configured_s = configured_s
        self.sleep, self.clock = sleep, clock
        self.leases_s: dict[str, float] = {}      # side -> lease it reported
        self.unsupported: set[str] = set()        # sides that answered UNIMPLEMENTED
        self.num_renewals = 0
        self._task: asyncio.Task[None] | None = None

    def interval_s(self) -> float:
        return keepalive_interval_s(self.configured_s, [self.generation.session.lease_s, *self.leases_s.values()])

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        """Wakes at least every POLL_S (the lease is learnt only once StartSession answers) and renews when an
        interval has passed since the last renewal (or the start)."""
        last = self.clock()
        while True:
            await self.sleep(min(self.interval_s(), POLL_S))
            if self.clock() - last >= self.interval_s():
                last = self.clock()
                with contextlib.suppress(Exception):
                    await self.renew_once()

    def _calls(self) -> list[tuple[str, Awaitable[common_pb2.KeepAliveResponse]]]:
        g = self.generation
        interval = self.interval_s()
        calls = []
        session = g.session                          # its replica now (a moved session renews where it went)
        if session.owner_token and session.replica is not None and "verifier" not in self.unsupported:
            request = common_pb2.KeepAliveRequest(session_id=g.session_id, owner_token=session.owner_token)
            calls.append(("verifier", session.replica.stub.KeepAlive(request, timeout=interval)))
        drafter = model_drafter_of(g.drafter)
        if drafter is not None and drafter.bytes_sent and "draft service" not in self.unsupported:
            request = common_pb2.KeepAliveRequest(session_id=drafter.session_id, owner_token=drafter.owner_token)
            calls.append(("draft service", drafter.stub.KeepAlive(request, timeout=interval)))
        return calls

    async def renew_once(self) -> None:
        calls = self._calls()
        results = await asyncio.gather(*(call for _, call in calls), return_exceptions=True)
        for (side, _), result in zip(calls, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError):
                if result.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.unsupported.add(side)
                log.debug("%s KeepAlive: %s", side, result.code().name)
            elif isinstance(result, common_pb2.KeepAliveResponse):
                self.num_renewals += 1
                if result.lease_s > 0:
                    self.leases_s[side] = result.lease_s
