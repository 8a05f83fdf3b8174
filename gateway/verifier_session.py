"""One request's session on a verifier replica, and moving it to another when that replica goes away.

The gateway's `RequestState` holds everything a session is made of (the prompt, every verified token, the budget
left), so a session can be opened again on another replica from it: StartSession with the prompt plus every token
emitted so far. The new replica's first token is the target's next token given exactly that context: the same
token an undisturbed greedy run produces, and a fresh draw from the target's distribution for a sampled one. A
seeded request keeps its seed: its draws are keyed by (seed, absolute position) (specmesh/spec/seeded.py), so the new
replica draws exactly the tokens the old one would have, the continuation is identical to an undisturbed run, and no
draw that chose an emitted token is replayed (those positions are behind it). Nothing the client received is sent
again, nothing is skipped.

A session moves when its Verify fails with UNAVAILABLE (the replica died or closed its port) or NOT_FOUND (it
restarted and lost its sessions), when its replica stops answering health probes or disappears from discovery while
a Verify waits (`Replica.lost`), and, between rounds, when its replica says it is draining and another one is
usable. At most `max_failovers` moves per request, each trying every candidate once; then UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from gateway.cleanup import END_SESSION_RETRY_S, end_until_done
from gateway.replicas import Replica, VerifierPool
from protos.specmesh.v1 import common_pb2, verifier_pb2
from specmesh.rpc.proto_convert import sampling_to_proto
from specmesh.spec.sampling import SamplingParams

log = logging.getLogger(__name__)

MOVABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
SKIPPABLE_ON_MOVE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND)


class SessionLost(Exception):
    """The session's replica went away mid-call (reason: unavailable, lost, draining)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


# called on each move: (reason, from replica, to replica or None when none was left, tokens emitted so far)
OnMove = Callable[[str, str, str | None, int], None]


PREFILL_S_PER_TOKEN = 0.1   # a StartSession may take this much longer per prompt token (a 10 tokens/s floor)


def prefill_timeout_s(timeout_s: float, num_prompt_tokens: int) -> float:
    """A StartSession's deadline: the verifier timeout plus PREFILL_S_PER_TOKEN a prompt token. A prompt near the
    context limit prefills for a minute alone on one CPU core and for twice that beside running streams (which go
    first); a flat 120 s killed such a request (DEADLINE_EXCEEDED) while its prefill was progressing."""
    return timeout_s + PREFILL_S_PER_TOKEN * num_prompt_tokens


class VerifierSession:
    def __init__(self, pool: VerifierPool, session_id: str, sampling: SamplingParams, speculative: bool,
                 timeout_s: float, max_failovers: int = 3, on_move: OnMove | None = None) -> None:
        self.pool = pool
        self.session_id = session_id
        self.sampling = sampling
        self.speculative = speculative
        self.timeout_s = timeout_s
        self.max_failovers = max_failovers
        self.on_move = on_move
        self.replica: Replica | None = None
        self.owner_token = ""                        # the replica's token for this session (from StartSession)
        self.lease_s = 0.0                           # its lease as the replica reported it (0: not known); renewed
                                                     # while the stream is open (gateway/keepalive.py)
        self.tenant = ""                             # the request's tenant, told to the verifier (admission share)
        self.cleanup_retry_s = END_SESSION_RETRY_S   # EndSession retried up to this long (gateway/cleanup.py)
        self.num_moves = 0
        self._ending: set[asyncio.Task[None]] = set()

    def _request(self, context_ids: list[int], max_new_tokens: int,
                 sampling: SamplingParams) -> verifier_pb2.StartSessionRequest:
        return verifier_pb2.StartSessionRequest(
            session_id=self.session_id, prompt_token_ids=context_ids, sampling=sampling_to_proto(sampling),
            max_new_tokens=max_new_tokens, speculative=self.speculative, tenant=self.tenant)

    def _candidates(self, context_ids: list[int], last: Replica | None = None) -> list[Replica]:
        """Placement's order; replicas the watch thinks down come after (its view may lag), the one just lost last."""
        ordered = self.pool.order(context_ids, exclude=[last] if last is not None else [])
        rest = [r for r in self.pool.all() if r not in ordered and r is not last]
        return ordered + rest + ([last] if last is not None and not last.removed else [])

    async def open(self, prompt_ids: list[int], max_new_tokens: int) -> verifier_pb2.StartSessionResponse:
        """The first StartSession: nothing was streamed yet, so a replica that is down or draining (UNAVAILABLE) is
        simply skipped; any other refusal is the request's answer."""
        candidates = self._candidates(prompt_ids)
        request = self._request(prompt_ids, max_new_tokens, self.sampling)
        for i, replica in enumerate(candidates):
            try:
                return await self._start(replica, request)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or i == len(candidates) - 1:
                    raise
                log.warning("verifier replica %s unavailable (%s); trying the next", replica.addr, exc.details())
        raise unavailable("no verifier replica is known (discovery found none)")

    async def _start(self, replica: Replica, request: verifier_pb2.StartSessionRequest
                     ) -> verifier_pb2.StartSessionResponse:
        replica.num_opened += 1                      # counted while it starts: a burst spreads over the replicas
        try:
            start: verifier_pb2.StartSessionResponse = await replica.stub.StartSession(
                request, timeout=prefill_timeout_s(self.timeout_s, len(request.prompt_token_ids)))
        except BaseException:
            replica.release()
            raise
        self.replica, self.owner_token, self.lease_s = replica, start.owner_token, start.lease_s
        return start

    async def move(self, lost: SessionLost, context_ids: list[int], max_new_tokens: int,
                   num_emitted: int) -> verifier_pb2.StartSessionResponse:
        """Opens the session again elsewhere with the whole verified context; UNAVAILABLE when no replica takes it
        or the request moved `max_failovers` times already."""
        old = self.replica
        old_addr = old.addr if old is not None else "?"
        self._release(end=True)
        if self.num_moves >= self.max_failovers:
            self._moved(lost.reason, old_addr, None, num_emitted)
            raise unavailable(f"verifier replica {old_addr} lost ({lost.detail}) and the stream already moved "
                              f"{self.num_moves} times (the most allowed)")
        self.num_moves += 1
        request = self._request(context_ids, max_new_tokens, self.sampling)
        errors: list[str] = []
        for replica in self._candidates(context_ids, last=old):
            try:
                start = await self._start(replica, request)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in SKIPPABLE_ON_MOVE:
                    raise
                errors.append(f"{replica.addr}: {exc.code().name}")
                continue
            log.warning("session %s moved from verifier %s to %s after %d tokens (%s)", self.session_id, old_addr,
                        replica.addr, num_emitted, lost)
            self._moved(lost.reason, old_addr, replica.addr, num_emitted)
            return start
        self._moved(lost.reason, old_addr, None, num_emitted)
        raise unavailable(f"verifier replica {old_addr} lost ({lost.detail}) and no replica left to continue the "
                          f"stream ({', '.join(errors) or 'none known'})")

    def _moved(self, reason: str, old: str, new: str | None, num_emitted: int) -> None:
        if self.on_move is not None:
            self.on_move(reason, old, new, num_emitted)

    def should_move(self) -> bool:
        """Between rounds: the replica is draining and another one could take the session."""
        replica = self.replica
        return replica is not None and replica.draining and self.num_moves < self.max_failovers and any(
            r.usable for r in self.pool.all() if r is not replica)

    async def verify(self, request: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        """The session's Verify, raced against its replica going away (SessionLost either way)."""
        replica = self.replica
        assert replica is not None, "verify before open"
        request.session_id, request.owner_token = self.session_id, self.owner_token
        if replica.lost.is_set():
            raise SessionLost("lost", f"{replica.addr} is down")
        call = asyncio.ensure_future(replica.stub.Verify(request, timeout=self.timeout_s))
        lost = asyncio.ensure_future(replica.lost.wait())
        try:
            await asyncio.wait({call, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not call.done():
                call.cancel()
        if not call.done() or call.cancelled():
            raise SessionLost("lost", f"{replica.addr} stopped answering health probes or left discovery")
        try:
            response: verifier_pb2.VerifyResponse = call.result()
        except grpc.aio.AioRpcError as exc:
            if exc.code() in MOVABLE:
                raise SessionLost("unavailable", f"{exc.code().name}: {exc.details()}") from exc
            raise
        replica.report(response)
        return response

    def _release(self, end: bool) -> None:
        """Forget the session's replica; with `end`, tell it in the background (best effort: a draining replica
        waits for its sessions, a dead one's lease reaps them)."""
        replica, token = self.replica, self.owner_token
        self.replica, self.owner_token = None, ""
        if replica is None:
            return
        if not (end and token):
            replica.release()
            return
        task = asyncio.ensure_future(self._end(replica, token, 2.0))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _end(self, replica: Replica, token: str, timeout_s: float) -> None:
        try:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await replica.stub.EndSession(common_pb2.EndSessionRequest(session_id=self.session_id,
                                                                           owner_token=token), timeout=timeout_s)
        finally:
            replica.release()                      # after the call: a removed replica's channel closes then

    async def close(self) -> bool:
        """Ends the session on its replica (runs even when the client went away), retried with backoff until done or
        moot (gateway/cleanup.py: a hung verifier frees it once it resumes). False: gave up (the lease ends it)."""
        replica, token = self.replica, self.owner_token
        if replica is None:
            return True
        self.replica, self.owner_token = None, ""
        try:
            if not token:
                return True
            request = common_pb2.EndSessionRequest(session_id=self.session_id, owner_token=token)
            return await end_until_done(lambda: replica.stub.EndSession(request, timeout=5.0), "verifier",
                                        self.cleanup_retry_s)
        finally:
            replica.release()
