"""VerifierSession: where a session opens, how it moves, the bound on moves (fake stubs, no model)."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from gateway.replicas import VerifierPool
from gateway.verifier_session import SessionLost, VerifierSession, prefill_timeout_s
from protos.specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from specmesh.spec.sampling import SamplingParams


def error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), code.name.lower())


class FakeVerifier:
    def __init__(self, name: str, refuse: grpc.StatusCode | None = None) -> None:
        self.name, self.refuse = name, refuse
        self.starts: list[verifier_pb2.StartSessionRequest] = []
        self.ended: list[str] = []
        self.verify_error: grpc.StatusCode | None = None
        self.hang = asyncio.Event()

    async def StartSession(self, request, timeout):  # noqa: N802, ANN001, ANN201
        self.starts.append(request)
        if self.refuse is not None:
            raise error(self.refuse)
        return verifier_pb2.StartSessionResponse(first_token_id=len(request.prompt_token_ids),
                                                 owner_token=f"{self.name}-token")

    async def Verify(self, request, timeout):  # noqa: N802, ANN001, ANN201
        if self.verify_error is not None:
            raise error(self.verify_error)
        if not self.hang.is_set():
            await asyncio.Event().wait()            # never answers (a frozen process)
        return verifier_pb2.VerifyResponse(num_accepted=0, token_ids=[1], num_sessions=3, draining=True)

    async def EndSession(self, request, timeout):  # noqa: N802, ANN001, ANN201
        self.ended.append(request.owner_token)


def session(*verifiers: FakeVerifier, max_failovers: int = 3, seed: int | None = 7) -> tuple[VerifierSession, list]:
    moves: list[tuple] = []
    pool = VerifierPool.of_stubs(list(verifiers), [v.name for v in verifiers])  # type: ignore[arg-type]
    return VerifierSession(pool, "s1", SamplingParams(temperature=1.0, seed=seed), True, 10.0, max_failovers,
                           lambda *move: moves.append(move)), moves


async def test_move_opens_the_whole_context_elsewhere_with_the_same_seed_and_ends_the_old_session() -> None:
    a, b = FakeVerifier("a"), FakeVerifier("b")
    s, moves = session(a, b)
    await s.open([1, 2, 3], 10)
    first, other = (a, b) if a.starts else (b, a)
    first.verify_error = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(SessionLost) as lost:
        await s.verify(verifier_pb2.VerifyRequest())
    start = await s.move(lost.value, [1, 2, 3, 4, 5], 8, 2)
    assert start.first_token_id == 5 and s.replica.stub is other        # the new replica's token after 5 tokens
    sent = other.starts[0]
    assert list(sent.prompt_token_ids) == [1, 2, 3, 4, 5] and sent.max_new_tokens == 8
    assert sent.sampling.seed == 7           # draws keyed by (seed, position): an undisturbed run's continuation
    await asyncio.sleep(0)
    assert first.ended == [f"{first.name}-token"]                          # the old session is let go
    (reason, old, new, emitted), = moves
    assert (reason, emitted) == ("unavailable", 2) and old.startswith(first.name) and new.startswith(other.name)


async def test_a_frozen_replica_marked_down_moves_the_waiting_verify() -> None:
    a = FakeVerifier("a")
    s, _ = session(a, FakeVerifier("b"), seed=None)
    await s.open([1], 4)
    replica = s.replica
    waiting = asyncio.ensure_future(s.verify(verifier_pb2.VerifyRequest()))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    replica.set_up(False)                                                  # what the health watch does
    with pytest.raises(SessionLost, match="lost"):
        await waiting


async def test_moves_skip_busy_replicas_and_are_bounded() -> None:
    a, full, b = FakeVerifier("a"), FakeVerifier("full", grpc.StatusCode.RESOURCE_EXHAUSTED), FakeVerifier("b")
    s, moves = session(a, full, b, max_failovers=1)
    s.replica = None
    start = await s.move(SessionLost("unavailable", "x"), [1, 2], 4, 1)   # whichever order: "full" is skipped
    assert start.owner_token in ("a-token", "b-token")
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await s.move(SessionLost("unavailable", "y"), [1, 2, 3], 3, 2)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "moved 1 times" in exc.value.details()
    assert moves[-1][2] is None


async def test_no_replica_left_is_unavailable_naming_them() -> None:
    s, _ = session(FakeVerifier("a", grpc.StatusCode.UNAVAILABLE), FakeVerifier("b", grpc.StatusCode.UNAVAILABLE))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await s.move(SessionLost("unavailable", "gone"), [1], 2, 0)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no replica left to continue the stream" in exc.value.details() and "a#0: UNAVAILABLE" in \
        exc.value.details()


async def test_a_draining_reply_asks_to_move_only_when_another_replica_is_usable() -> None:
    a, b = FakeVerifier("a"), FakeVerifier("b")
    s, _ = session(a, b)
    await s.open([1], 4)
    s.replica.stub.hang.set()
    await s.verify(verifier_pb2.VerifyRequest())                           # answered, and says it is draining
    assert s.replica.draining and s.replica.num_sessions == 3 and s.should_move()
    for r in s.pool.all():
        if r is not s.replica:
            r.set_up(False)
    assert not s.should_move()                                             # nowhere to go: it stays


async def test_a_moved_sampled_session_continues_from_the_targets_distribution() -> None:
    """Invariant 2 across a move: the first token after the move, drawn by another replica prefilled with the
    context, follows the target's distribution given that context (the seed is kept: seeded draws are keyed by
    absolute position, so the move draws a position the first replica never drew)."""
    from transformers import AutoTokenizer

    from gateway.channels import internal_channel
    from specmesh.models import resolve_model_dir
    from tests.stack import start_verifier
    from tests.test_sampling_e2e import NUM_SAMPLES, PARAMS, PROMPT, assert_follows, target_probs

    replicas = [await start_verifier(), await start_verifier()]
    channels = []

    def make(addr: str):  # noqa: ANN202
        channels.append(internal_channel(addr))
        return verifier_pb2_grpc.VerifierStub(channels[-1]), channels[-1]

    pool = VerifierPool(make, [r.addr for r in replicas])
    prompt_ids = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))(PROMPT)["input_ids"]

    async def one(seed: int) -> tuple[int, int]:
        params = SamplingParams(temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=seed)
        s = VerifierSession(pool, f"moved-{seed}", params, False, 30.0)
        first = (await s.open(prompt_ids, 2)).first_token_id
        before = s.replica
        start = await s.move(SessionLost("unavailable", "test"), [*prompt_ids, first], 1, 1)
        assert s.replica is not before
        await s.close()
        return first, start.first_token_id

    try:
        pairs: list[tuple[int, int]] = []
        for start in range(0, NUM_SAMPLES, 40):
            pairs += await asyncio.gather(*(one(seed) for seed in range(start, start + 40)))
    finally:
        for channel in channels:
            await channel.close()
        for r in replicas:
            await r.stop()
    assert_follows([a for a, _ in pairs], target_probs(prompt_ids))
    first = collections.Counter(a for a, _ in pairs).most_common(1)[0][0]
    second = [b for a, b in pairs if a == first]
    assert len(second) >= 60
    assert_follows(second, target_probs([*prompt_ids, first]))


def test_a_long_prompt_gets_time_to_prefill() -> None:
    """A 3,900-token prompt prefills for ~65 s alone on one core and ~2x that beside a stream: its StartSession is
    not cut at the flat verifier timeout."""
    assert prefill_timeout_s(120.0, 0) == 120.0
    assert prefill_timeout_s(120.0, 3900) == pytest.approx(510.0)
