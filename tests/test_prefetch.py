"""Draft prefetch: the gateway asks for the next block while the verifier works; a hit saves the draft link's round
trip, a miss is dropped, and either way the drafts equal what a fresh draft session proposes for the context."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest
import pytest_asyncio

from draft_service.engine import Drafts
from gateway.proposers.base import Draft
from gateway.proposers.draft_model import ModelDrafter
from protos.specmesh.v1 import common_pb2, draft_pb2_grpc
from specmesh.engine.loop import EngineError
from specmesh.spec.sampling import SamplingParams
from tests.stack import start_draft

CONTEXT = [(7 * i + 3) % 200 + 10 for i in range(120)]
_ids = itertools.count()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def draft():
    running = await start_draft("tiny-draft")
    channel = grpc.aio.insecure_channel(running.addr)
    yield running, draft_pb2_grpc.DraftStub(channel)
    await channel.close()
    await running.stop()


def new_drafter(stub: draft_pb2_grpc.DraftStub) -> ModelDrafter:
    return ModelDrafter(stub, f"prefetch-{next(_ids)}", SamplingParams(), timeout_s=30.0)


async def fresh_draft(stub: draft_pb2_grpc.DraftStub, context: list[int], k: int) -> list[int]:
    """What a new session proposes for `context` (the reference a prefetch must agree with)."""
    drafter = new_drafter(stub)
    try:
        return (await drafter.propose(context, k)).token_ids
    finally:
        await drafter.close()


async def test_prefetch_hit_serves_the_next_block(draft) -> None:
    _, stub = draft
    drafter = new_drafter(stub)
    block = await drafter.propose(CONTEXT, 4)
    drafter.prefetch(CONTEXT, block, 4)
    guess = await fresh_draft(stub, CONTEXT + block.token_ids, 5)    # the draft's own next token, then 4 more
    verified = CONTEXT + block.token_ids + guess[:1]                 # all accepted, bonus token == the guess
    sent = drafter.bytes_sent
    nxt = await drafter.propose(verified, 4)
    assert nxt.token_ids == guess[1:] == await fresh_draft(stub, verified, 4)
    assert nxt.source == common_pb2.DRAFT_SOURCE_MODEL
    assert drafter.num_prefetch_hits == 1 and drafter.bytes_sent == sent     # no Propose waited for
    await drafter.close()


@pytest.mark.parametrize("num_accepted", [0, 2, 4])
async def test_prefetch_miss_is_dropped_and_drafts_stay_right(draft, num_accepted: int) -> None:
    """Rejected at `num_accepted` (or all accepted with a bonus token the draft did not guess)."""
    _, stub = draft
    drafter = new_drafter(stub)
    block = await drafter.propose(CONTEXT, 4)
    drafter.prefetch(CONTEXT, block, 4)
    guess = await fresh_draft(stub, CONTEXT + block.token_ids, 1)
    wrong = (block.token_ids + guess)[num_accepted] + 1            # the target's correction differs from the draft
    verified = CONTEXT + block.token_ids[:num_accepted] + [wrong]
    sent = drafter.bytes_sent
    nxt = await drafter.propose(verified, 4)
    assert nxt.token_ids == await fresh_draft(stub, verified, 4)
    assert drafter.num_prefetch_hits == 0 and drafter.num_failures == 0 and drafter.skip_rounds == 0
    # Only the tokens after the common prefix crossed the link, not the 120-token context again.
    assert drafter.bytes_sent - sent < 60
    await drafter.close()


async def test_newer_propose_supersedes_one_still_drafting(draft) -> None:
    """The draft engine answers ABORTED to a Propose overtaken by a newer one for the same session (never
    FAILED_PRECONDITION), and the newer one gets the drafts for its own context."""
    running, stub = draft
    engine = running.engine
    corrected = CONTEXT[:116] + [CONTEXT[116] + 1]      # the prefetch assumed CONTEXT[116:]; position 116 differs
    expected = await fresh_draft(stub, corrected, 3)
    for attempt in range(20):
        session = f"supersede-{attempt}"
        first = engine.propose(session, len(CONTEXT), CONTEXT, 16, SamplingParams(), 0, 0, num_assumed_tokens=4)
        second = engine.propose(session, len(corrected), corrected[116:], 3, SamplingParams(), 0, 0)
        results = await asyncio.gather(first.future, second.future, return_exceptions=True)
        engine.end_session(session)
        assert isinstance(results[1], Drafts) and results[1].draft_ids == expected
        if isinstance(results[0], EngineError):
            assert results[0].code == "ABORTED"
            return
        assert isinstance(results[0], Drafts)
    pytest.fail("the first Propose always finished before the second arrived; supersede never exercised")


@pytest.mark.parametrize("context_len", [14, 16, 30])
async def test_assumed_tokens_filling_a_kv_block_can_be_replaced(draft, context_len: int) -> None:
    """Assumed tokens that complete a KV block are not cached as verified, so a rejection can replace them."""
    running, stub = draft
    resets = running.engine.num_resets
    context = CONTEXT[:context_len]
    drafter = new_drafter(stub)
    block = await drafter.propose(context, 4)
    drafter.prefetch(context, block, 4)
    await asyncio.sleep(0.05)                           # the prefetch is applied on the service
    verified = context + [block.token_ids[0] + 1]       # rejected at the first position
    nxt = await drafter.propose(verified, 4)
    assert nxt.token_ids == await fresh_draft(stub, verified, 4)
    assert drafter.num_failures == 0
    assert running.engine.num_resets == resets          # the session kept its verified KV
    await drafter.close()


async def test_prefetch_only_continues_model_drafts(draft) -> None:
    _, stub = draft
    drafter = new_drafter(stub)
    drafter.prefetch(CONTEXT, Draft([1, 2, 3], None, common_pb2.DRAFT_SOURCE_NGRAM), 4)
    assert not drafter.prefetching
    drafter.prefetch(CONTEXT, Draft([1, 2, 3], None, common_pb2.DRAFT_SOURCE_MODEL), 0)
    assert not drafter.prefetching
    await drafter.close()


@pytest.mark.parametrize("context_len", [116, 112])
async def test_a_context_shorter_than_the_assumed_one_drafts_again(draft, context_len: int) -> None:
    """A call whose context drops assumed tokens whose KV is already computed (here: all of them, so the context is
    a strict prefix of what the session ran) must run its last token again to draft from it, also when that token
    sits in a verified block the prefix cache has hashed (context_len 112 = 7 full blocks)."""
    running, stub = draft
    engine = running.engine
    context = CONTEXT[:context_len]
    expected = await fresh_draft(stub, context, 3)
    session = f"shorter-{context_len}"
    assumed = CONTEXT[:context_len + 4]
    first = await engine.propose(session, len(assumed), assumed, 4, SamplingParams(), 0, 0,
                                 num_assumed_tokens=4).future
    assert len(first.draft_ids) == 4
    again = await engine.propose(session, context_len, [], 3, SamplingParams(), 0, 0).future
    engine.end_session(session)
    assert again.draft_ids == expected
