"""Contract test of the draft link (protos/specmesh/v1/draft.proto): both halves driven together.

1. The pure client state machine (gateway/draft_link.py) against a scripted service built on the service half's own
   sync rules (draft_service/session_sync.py): after every answered call the service holds exactly the context the
   client meant, through fresh sessions, rounds, prefetch hits and misses, rejections, supersedes, restarts, lease
   expiry and a foreign owner token.
2. The gateway half (ModelDrafter) against a real tiny draft service in-process: same scenarios, and every draft
   equals what a fresh session proposes for the same context.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import socket

import grpc
import pytest
import pytest_asyncio

from draft_service.server import build_draft
from draft_service.session_sync import place_delta, plan_sync
from gateway.draft_link import BACKOFF_ROUNDS, DraftLink, LinkCall, LinkState, OnError
from gateway.proposers.draft_model import ModelDrafter, sync_timeout_s
from protos.specmesh.v1 import draft_pb2_grpc
from specmesh.config import DraftConfig, EngineConfig
from specmesh.engine.loop import EngineError
from specmesh.spec.sampling import SamplingParams
from tests.stack import Running, start_draft

# ---- 1. client state machine x scripted service ---------------------------------------------------------------


def next_token(context: list[int]) -> int:
    return (context[-1] * 31 + len(context)) % 97


@dataclasses.dataclass
class _Session:
    token_ids: list[int]
    num_verified: int
    context_len: int
    owner: str


class ScriptedService:
    """The service half's sync (place_delta, plan_sync) over a fake model (`next_token`), with draft-ahead: after
    answering, the tail holds k + 1 drafted tokens. Failures are injected by the test."""

    def __init__(self) -> None:
        self.sessions: dict[str, _Session] = {}
        self.contexts: list[list[int]] = []          # the context each answered call ended up holding

    def propose(self, call: LinkCall, k: int, owner: str = "me", sid: str = "s") -> list[int]:
        session = self.sessions.get(sid)
        if session is not None and session.owner != owner:
            raise EngineError("PERMISSION_DENIED", "not the owner")
        base = place_delta(session is not None, session.context_len if session else 0, call.context_len,
                           len(call.new_token_ids))
        if session is None:
            session = self.sessions[sid] = _Session([], 0, 0, owner)
        context = session.token_ids[:base] + call.new_token_ids
        plan = plan_sync(session.token_ids, session.num_verified, session.context_len, context,
                         call.num_assumed_tokens)
        if plan.reset or plan.tail_kept_from is None:
            session.token_ids = list(context)
        session.context_len, session.num_verified = len(context), plan.num_verified
        self.contexts.append(list(context))
        while len(session.token_ids) < len(context) + k + 1:         # draft k, then one ahead
            session.token_ids.append(next_token(session.token_ids))
        return session.token_ids[len(context):len(context) + k]


def round_trip(link: DraftLink, service: ScriptedService, context: list[int], k: int,
               num_verified: int | None = None, owner: str = "me") -> list[int] | OnError:
    """One Propose through the link, resending as the link says; the drafts or the link's verdict."""
    if not link.round_allowed():
        return OnError.SKIP
    for _ in range(2):
        num_unsynced = link.num_unsynced(context)
        call = link.send(context, num_verified)
        assert len(call.new_token_ids) == num_unsynced             # what a catch-up check reads is what is sent
        try:
            drafts = service.propose(call, k, owner)
        except EngineError as exc:
            verdict = link.on_error(call, exc.code)
            if verdict is OnError.RESEND_WHOLE:
                continue
            return verdict
        assert service.contexts[-1] == context                     # the service holds what the client meant
        return drafts
    raise AssertionError("resent twice")


def reference(context: list[int], k: int) -> list[int]:
    out = list(context)
    for _ in range(k):
        out.append(next_token(out))
    return out[len(context):]


def test_fresh_session_sends_the_whole_context_then_only_deltas() -> None:
    link, service = DraftLink(), ScriptedService()
    context = list(range(10, 40))
    assert link.state is LinkState.UNBOUND
    call = link.send(context)
    assert call.whole_context and link.state is LinkState.SYNCED
    assert service.propose(call, 4) == reference(context, 4)
    for accepted in (4, 2, 0, 3):                                   # all accepted, rejections mid-block
        drafts = reference(context, 4)
        context = context + drafts[:accepted] + [999 - accepted]    # the target's own token
        call = link.send(context)
        assert len(call.new_token_ids) == accepted + 1              # only the newly verified tokens
        assert service.propose(call, 4) == reference(context, 4)
        assert service.contexts[-1] == context


def test_prefetch_hit_and_miss_keep_the_service_in_sync() -> None:
    link, service = DraftLink(), ScriptedService()
    context = list(range(5, 30))
    block = round_trip(link, service, context, 4)
    assert isinstance(block, list)
    # Prefetch: assume the block accepted and ask for 1 + k after it (num_verified = the real context).
    prefetch = link.send(context + block, num_verified=len(context))
    assert prefetch.new_token_ids == block and prefetch.num_assumed_tokens == len(block)
    guess = service.propose(prefetch, 5)
    assert service.sessions["s"].num_verified == len(context)      # assumed tokens are not verified
    hit = context + block + guess[:1]
    call = link.send(hit)
    assert call.new_token_ids == guess[:1]                          # the assumed block is not sent again
    assert service.propose(call, 4) == reference(hit, 4)
    # A miss: the prefetch assumed the block, the target rejected at 1.
    block = reference(hit, 4)
    service.propose(link.send(hit + block, num_verified=len(hit)), 5)
    miss = hit + block[:1] + [1000]
    call = link.send(miss)
    assert call.new_token_ids == [1000]
    assert service.propose(call, 4) == reference(miss, 4) and service.contexts[-1] == miss


def test_superseded_prefetch_is_skipped_and_the_later_call_stands() -> None:
    link, service = DraftLink(), ScriptedService()
    context = list(range(5, 30))
    round_trip(link, service, context, 4)
    prefetch = link.send(context + [1, 2], num_verified=len(context))
    nxt = context + [1, 7]
    call = link.send(nxt)                                           # sent before the prefetch's answer
    service.propose(prefetch, 3)
    assert link.on_error(prefetch, "ABORTED") is OnError.SKIP       # the service superseded it
    assert link.state is LinkState.SYNCED and link.num_failures == 0
    assert service.propose(call, 3) == reference(nxt, 3) and service.contexts[-1] == nxt


def test_an_earlier_call_lost_unbinds_so_the_next_call_is_whole() -> None:
    link, service = DraftLink(), ScriptedService()
    context = list(range(5, 30))
    round_trip(link, service, context, 4)
    prefetch = link.send(context + [1, 2], num_verified=len(context))
    link.send(context + [1, 7])                                      # sent, computed against the prefetch
    assert link.on_error(prefetch, "UNAVAILABLE") is OnError.SKIP    # the prefetch may never have arrived
    assert link.state is LinkState.UNBOUND and link.num_failures == 0
    assert link.send(context + [1, 7, 8]).whole_context


@pytest.mark.parametrize("lost", ["restart", "lease_expiry"])
def test_a_lost_session_is_resent_whole_at_once(lost: str) -> None:
    link, service = DraftLink(), ScriptedService()
    context = list(range(5, 30))
    round_trip(link, service, context, 4)
    if lost == "restart":
        service = ScriptedService()                                  # a new process: nothing held
    else:
        del service.sessions["s"]                                    # the reaper ended the idle session
    context = context + [3, 4]
    assert round_trip(link, service, context, 4) == reference(context, 4)
    assert link.num_resends == 1 and link.num_failures == 0 and link.state is LinkState.SYNCED
    assert service.sessions["s"].num_verified == len(context)


def test_foreign_owner_token_backs_off_then_rebinds_whole() -> None:
    link, service = DraftLink(), ScriptedService()
    context = list(range(5, 30))
    round_trip(link, service, context, 4)
    assert round_trip(link, service, context + [1], 4, owner="intruder") is OnError.FAILURE
    assert link.state is LinkState.BACKOFF and link.num_failures == 1
    for _ in range(BACKOFF_ROUNDS):
        assert round_trip(link, service, context + [1], 4) is OnError.SKIP
    assert link.state is LinkState.UNBOUND
    call = link.send(context + [1])
    assert call.whole_context


def test_random_operations_keep_both_halves_in_sync() -> None:
    rng = random.Random(14)
    for _ in range(30):
        link, service = DraftLink(), ScriptedService()
        context = [rng.randrange(90) for _ in range(rng.randrange(1, 20))]
        for _ in range(40):
            op = rng.random()
            if op < 0.1:
                service = ScriptedService()
            elif op < 0.2:                                              # a prefetch lost on the way: reported
                lost = link.send(context + [1, 2, 3], num_verified=len(context))
                assert link.on_error(lost, rng.choice(["UNAVAILABLE", "DEADLINE_EXCEEDED"])) is OnError.FAILURE
            elif op < 0.3 and len(context) > 3:
                service.sessions.pop("s", None)
            drafts = round_trip(link, service, context, rng.randrange(0, 5))
            if isinstance(drafts, list):
                assert drafts == reference(context, len(drafts))
                accepted = rng.randrange(len(drafts) + 1)
                context = context + drafts[:accepted] + [rng.randrange(90)]
            else:
                context = context + [rng.randrange(90)]


# ---- 2. gateway half x a real tiny draft service -----------------------------------------------------------------

CONTEXT = [(11 * i + 5) % 200 + 10 for i in range(60)]
_ids = itertools.count()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def draft():
    running = await start_draft("tiny-draft")
    channel = grpc.aio.insecure_channel(running.addr)
    yield running, draft_pb2_grpc.DraftStub(channel)
    await channel.close()
    await running.stop()


def new_drafter(stub: draft_pb2_grpc.DraftStub, session_id: str | None = None) -> ModelDrafter:
    return ModelDrafter(stub, session_id or f"link-{next(_ids)}", SamplingParams(), timeout_s=30.0)


async def fresh(stub: draft_pb2_grpc.DraftStub, context: list[int], k: int) -> list[int]:
    drafter = new_drafter(stub)
    try:
        return (await drafter.propose(context, k)).token_ids
    finally:
        await drafter.close()


async def test_rounds_with_prefetch_hits_misses_and_rejections(draft) -> None:
    _, stub = draft
    drafter = new_drafter(stub)
    context = list(CONTEXT)
    block = await drafter.propose(context, 4)
    assert drafter.link.state is LinkState.SYNCED
    for accepted, guessed in ((4, True), (4, False), (1, False), (0, False), (4, True)):
        drafter.prefetch(context, block, 4)
        after = await fresh(stub, context + block.token_ids, 1)
        target_token = after[0] if guessed else (block.token_ids + after)[accepted] + 1
        context = context + block.token_ids[:accepted] + [target_token]
        hits, sent = drafter.num_prefetch_hits, drafter.bytes_sent
        block = await drafter.propose(context, 4)
        assert block.token_ids == await fresh(stub, context, 4)
        assert drafter.num_prefetch_hits == hits + guessed
        assert drafter.bytes_sent - sent < (1 if guessed else 60)   # a hit sends nothing; a miss only the delta
    assert drafter.num_failures == 0 and drafter.link.num_resends == 0
    await drafter.close()


async def test_restarted_service_gets_the_whole_context(draft) -> None:
    _, stub = draft
    drafter = new_drafter(stub)
    first = await drafter.propose(CONTEXT, 3)
    restarted = await start_draft("tiny-draft")                     # a fresh process holds no sessions
    try:
        async with grpc.aio.insecure_channel(restarted.addr) as channel:
            drafter.stub = draft_pb2_grpc.DraftStub(channel)
            context = CONTEXT + first.token_ids + [7]
            again = await drafter.propose(context, 3)
            assert again.token_ids == await fresh(stub, context, 3)
            assert drafter.link.num_resends == 1 and drafter.num_failures == 0
            await drafter.close()
    finally:
        await restarted.stop()


async def test_expired_lease_is_resent_whole() -> None:
    config = DraftConfig(port=0, session_lease_s=0.3, engine=EngineConfig(model="tiny-draft", kv_cache_memory_mb=16))
    server, engine = build_draft(config)
    running = Running(server, await server.start("127.0.0.1", 0), engine)
    try:
        async with grpc.aio.insecure_channel(running.addr) as channel:
            drafter = new_drafter(draft_pb2_grpc.DraftStub(channel))
            first = await drafter.propose(CONTEXT, 3)
            for _ in range(100):                                    # the reaper ends the idle session
                if not engine.sessions:
                    break
                await asyncio.sleep(0.1)
            assert not engine.sessions
            again = await drafter.propose(CONTEXT + first.token_ids + [5], 3)
            assert len(again.token_ids) == 3
            assert drafter.link.num_resends == 1 and drafter.num_failures == 0
            await drafter.close()
    finally:
        await running.stop()


async def test_a_lost_session_of_a_long_context_is_not_resent_in_the_round(draft) -> None:
    """With `resend_in_round_max` (suffix drafting), a round whose Propose finds the session gone (a restart, an
    expired lease) does not resend a longer context whole inside the round, where the draft's prefill of it would
    hold the stream: the round gets no drafts, the link is left unbound (no failure, no backoff), and the resend
    outside the round (`sync`) rebinds it with drafts a fresh session would make. A short context is resent in the
    round as before."""
    _, stub = draft
    restarted = await start_draft("tiny-draft")                     # a fresh process holds no sessions
    try:
        async with grpc.aio.insecure_channel(restarted.addr) as channel:
            for resend_max, long in ((len(CONTEXT) + 2, True), (len(CONTEXT) + 8, False)):
                drafter = new_drafter(stub)
                drafter.resend_in_round_max = resend_max
                first = await drafter.propose(CONTEXT, 3)
                drafter.stub = draft_pb2_grpc.DraftStub(channel)    # the service lost the session
                context = CONTEXT + first.token_ids + [7]
                sent = drafter.bytes_sent
                again = await drafter.propose(context, 3)
                assert drafter.link.num_resends == 1 and drafter.num_failures == 0
                if long:
                    assert again.token_ids == [] and drafter.link.state is LinkState.UNBOUND
                    assert drafter.bytes_sent - sent < 60                  # the delta only, never the whole context
                    await drafter.sync(context, 3, backs_off=True)
                    assert drafter.link.state is LinkState.SYNCED
                    context = context + [9]
                    again = await drafter.propose(context, 3)
                assert again.token_ids == await fresh(stub, context, 3)
                await drafter.close()
    finally:
        await restarted.stop()


async def test_another_owner_token_is_refused_and_backs_off(draft) -> None:
    _, stub = draft
    owner = new_drafter(stub, "owned-session")
    await owner.propose(CONTEXT, 3)
    intruder = new_drafter(stub, "owned-session")                   # same session id, its own token
    assert (await intruder.propose(CONTEXT, 3)).token_ids == []
    assert intruder.num_failures == 1 and intruder.link.state is LinkState.BACKOFF
    assert (await owner.propose(CONTEXT + [9], 3)).token_ids == await fresh(stub, CONTEXT + [9], 3)
    await owner.close()


async def test_a_superseded_prefetch_leaves_the_link_synced(draft) -> None:
    running, stub = draft
    drafter = new_drafter(stub)
    block = await drafter.propose(CONTEXT, 4)
    drafter.prefetch(CONTEXT, block, 12)                              # long: still drafting when superseded
    context = CONTEXT + block.token_ids[:1] + [block.token_ids[1] + 1]
    resets = running.engine.num_resets
    nxt = await drafter.propose(context, 4)
    assert nxt.token_ids == await fresh(stub, context, 4)
    await asyncio.sleep(0.05)                                         # the prefetch's ABORTED has been read
    assert drafter.link.state is LinkState.SYNCED and drafter.num_failures == 0
    assert running.engine.num_resets == resets
    await drafter.close()


async def test_a_sync_is_answered_once_computed_and_a_failed_resend_backs_off(draft) -> None:
    """Suffix drafting's prefill and its resend after a failed call (ProposerSet.sync_in_background) send the whole
    context outside any round and return once the draft service has computed it: the next round sends only the delta
    and finds the KV there (no wait behind a prefill), drafting what a fresh session would. A resend to a service
    that is still down fails like a round's call: the link backs off (no whole context every round); a failed
    prefill only unbinds (that request drafts without the model)."""
    running, stub = draft
    drafter = new_drafter(stub)
    await drafter.sync(CONTEXT, 3)
    assert drafter.link.state is LinkState.SYNCED and drafter.num_failures == 0
    session = running.engine.sessions[drafter.session_id]
    assert session.seq.num_computed >= len(CONTEXT)                  # computed when answered, not merely held
    sent = drafter.bytes_sent
    block = await drafter.propose(CONTEXT + [5], 3)
    assert block.token_ids == await fresh(stub, CONTEXT + [5], 3)
    assert drafter.bytes_sent - sent < 60                            # the delta, not the context again
    await drafter.close()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{closed_port()}") as channel:
        dead = new_drafter(draft_pb2_grpc.DraftStub(channel))
        dead.timeout_s = 2.0
        await dead.sync(CONTEXT, 3)
        assert dead.num_failures == 0 and dead.link.state is LinkState.UNBOUND
        await dead.sync(CONTEXT, 3, backs_off=True)
        assert dead.num_failures == 1 and dead.link.state is LinkState.BACKOFF
        assert dead.link.backoff_rounds == BACKOFF_ROUNDS


def test_a_sync_deadline_grows_with_the_context() -> None:
    assert sync_timeout_s(30.0, 100) == 30.0
    assert sync_timeout_s(30.0, 4096) == 120.0


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
