"""Cleanup that completes: EndSession retried with backoff until done (gateway/cleanup.py), the draft service's
Propose / EndSession race closed (draft_service/ended_sessions.py), and the health probe's NOT_SERVING time on a
virtual clock (gateway/health.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from draft_service.ended_sessions import EndedSessions
from gateway.cleanup import backoff_s, end_until_done
from gateway.health import VerifierWatch
from gateway.replicas import VerifierPool
from protos.specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2
from tests.stack import Running, start_draft

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), f"{code.name} (test)")


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


class FlakyCall:
    """Fails with the given codes in turn, then succeeds."""

    def __init__(self, *codes: grpc.StatusCode) -> None:
        self.codes = list(codes)
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.codes:
            raise rpc_error(self.codes.pop(0))


async def test_end_session_is_retried_with_backoff_until_it_succeeds() -> None:
    clock = VirtualClock()
    call = FlakyCall(UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, UNAVAILABLE)
    assert await end_until_done(call, "verifier", 600.0, clock.sleep, clock)
    assert call.calls == 4 and clock.sleeps == [0.2, 0.4, 0.8]
    assert [backoff_s(n) for n in (1, 5, 6, 20)] == [0.2, 3.2, 5.0, 5.0]


@pytest.mark.parametrize("code", [grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND])
async def test_a_session_already_gone_ends_the_retries(code: grpc.StatusCode) -> None:
    clock = VirtualClock()
    call = FlakyCall(UNAVAILABLE, code, UNAVAILABLE)
    assert await end_until_done(call, "draft service", 600.0, clock.sleep, clock)
    assert call.calls == 2


async def test_retries_give_up_once_the_lease_makes_them_moot() -> None:
    clock = VirtualClock()
    call = FlakyCall(*[UNAVAILABLE] * 1000)
    assert not await end_until_done(call, "verifier", 30.0, clock.sleep, clock)
    assert clock.now <= 30.0 and clock.now + 5.0 > 30.0             # retried for as long as allowed, no longer
    assert call.calls == len(clock.sleeps) + 1


def test_ended_sessions_are_remembered_for_a_while() -> None:
    clock = VirtualClock()
    ended = EndedSessions(keep_s=10.0, max_entries=3, clock=clock)
    ended.remember("s1", "tok")
    assert ended.ended("s1", "tok") and not ended.ended("s1", "other") and not ended.ended("s2", "tok")
    clock.now = 9.9
    assert ended.ended("s1", "tok")
    clock.now = 10.0
    assert not ended.ended("s1", "tok") and len(ended) == 0        # forgotten after keep_s
    for i in range(5):
        ended.remember(f"s{i}", "tok")
    assert len(ended) == 3 and not ended.ended("s0", "tok") and ended.ended("s4", "tok")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def draft():
    running = await start_draft()
    yield running
    await running.stop()


def whole_context(session_id: str, token: str) -> draft_pb2.ProposeRequest:
    context = list(range(3, 20))
    return draft_pb2.ProposeRequest(session_id=session_id, owner_token=token, context_len=len(context),
                                    new_token_ids=context, num_draft_tokens=2)


async def code_of(call) -> grpc.StatusCode:  # noqa: ANN001 - an awaitable gRPC call
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_a_propose_arriving_after_its_end_session_creates_nothing(draft: Running) -> None:
    """The race, driven in order: the EndSession arrives first (the session does not exist yet), then the Propose
    that would have created it."""
    async with grpc.aio.insecure_channel(draft.addr) as channel:
        stub = draft_pb2_grpc.DraftStub(channel)
        end = common_pb2.EndSessionRequest(session_id="raced", owner_token="tok")
        assert await code_of(stub.EndSession(end)) == grpc.StatusCode.PERMISSION_DENIED   # nothing to end yet
        assert await code_of(stub.Propose(whole_context("raced", "tok"))) == grpc.StatusCode.CANCELLED
        assert "raced" not in draft.engine.sessions
        # Someone else's token does not match what was ended: that Propose is not the late one.
        assert await code_of(stub.Propose(whole_context("raced", "other"))) == grpc.StatusCode.OK
        await stub.EndSession(common_pb2.EndSessionRequest(session_id="raced", owner_token="other"))
        # A session that existed: a whole-context Propose after its EndSession does not re-create it either.
        assert await code_of(stub.Propose(whole_context("existed", "tok"))) == grpc.StatusCode.OK
        await stub.EndSession(common_pb2.EndSessionRequest(session_id="existed", owner_token="tok"))
        assert await code_of(stub.Propose(whole_context("existed", "tok"))) == grpc.StatusCode.CANCELLED
    for _ in range(200):
        if not draft.engine.sessions and draft.engine.block_manager.num_used_blocks == 0:
            break
        await asyncio.sleep(0.05)
    assert not draft.engine.sessions and draft.engine.block_manager.num_used_blocks == 0


class HangingVerifier:
    """GetModelInfo answers while `up`, else waits out the caller's timeout (on the virtual clock)."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.up = True

    async def GetModelInfo(self, request: object, timeout: float) -> verifier_pb2.ModelInfo:  # noqa: N802
        if self.up:
            return verifier_pb2.ModelInfo()
        await self.clock.sleep(timeout)
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)


@pytest.mark.parametrize(("interval_s", "timeout_s", "failures"), [(1.0, 2.0, 2), (0.25, 0.5, 3)])
async def test_a_hung_verifier_is_not_serving_within_the_documented_time(interval_s: float, timeout_s: float,
                                                                         failures: int) -> None:
    clock = VirtualClock()
    verifier = HangingVerifier(clock)
    changes: list[tuple[float, bool]] = []

    async def on_change(serving: bool) -> None:
        changes.append((clock.now, serving))

    watch = VerifierWatch(VerifierPool.of_stubs([verifier], ["v"]), on_change, interval_s, timeout_s, failures,  # type: ignore[list-item]
                          sleep=clock.sleep)
    task = asyncio.ensure_future(watch._run())
    try:
        while clock.now < 3 * interval_s:            # healthy for a while: no change
            await asyncio.sleep(0)
        assert changes == []
        verifier.up = False                        # hangs just after a probe answered
        hung_at = clock.now
        while not changes:
            await asyncio.sleep(0)
        down_after = changes[0][0] - hung_at
        assert changes[0][1] is False
        assert down_after <= watch.down_within_s == failures * (interval_s + timeout_s)
        assert down_after > (failures - 1) * (interval_s + timeout_s)     # not before `failures` probes failed
        verifier.up = True
        back_at = clock.now
        while len(changes) < 2:
            await asyncio.sleep(0)
        assert changes[1][1] is True and changes[1][0] - back_at <= interval_s + timeout_s
    finally:
        task.cancel()


class FlakyVerifier:
    """EndSession fails twice (UNAVAILABLE: a verifier hung or restarting), then ends the session."""

    def __init__(self) -> None:
        self.requests: list[common_pb2.EndSessionRequest] = []

    def EndSession(self, request: common_pb2.EndSessionRequest, timeout: float):  # noqa: ANN201, N802
        self.requests.append(request)

        async def answer() -> common_pb2.EndSessionResponse:
            if len(self.requests) < 3:
                raise rpc_error(UNAVAILABLE)
            return common_pb2.EndSessionResponse()
        return answer()


async def test_a_generation_ends_its_verifier_session_after_failures() -> None:
    from gateway.round_loop import Generation
    from gateway.validation import GenerationParams
    from specmesh.spec.sampling import SamplingParams

    verifier = FlakyVerifier()
    params = GenerationParams("r", [1, 2], SamplingParams(), 4, (), 0, True)
    pool = VerifierPool.of_stubs([verifier])   # type: ignore[list-item]
    generation = Generation(params, "r-1234", pool, None, 10.0)
    replica = pool.all()[0]
    replica.num_opened += 1                                  # as StartSession on it answered "tok"
    generation.session.replica, generation.session.owner_token = replica, "tok"
    await generation.close()
    assert len(verifier.requests) == 3
    assert {(r.session_id, r.owner_token) for r in verifier.requests} == {("r-1234", "tok")}
