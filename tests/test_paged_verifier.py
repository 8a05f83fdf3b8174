"""The paged verifier under pressure: preemption, chunked prefill, prefix sharing, admission control."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from transformers import AutoTokenizer

from protos.specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from specmesh.engine.loop import EngineError
from specmesh.models import resolve_model_dir
from specmesh.spec.sampling import SamplingParams
from tests.stack import reference_greedy, start_draft, start_gateway, start_verifier
from tests.test_e2e_greedy import PROMPTS, generate, wait_blocks_free


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))


async def test_preemption_when_blocks_run_out_keeps_outputs_exact(tokenizer) -> None:
    """24 blocks of 4 tokens cannot hold 6 sessions of ~40 tokens: sessions are preempted and recomputed."""
    verifier = await start_verifier(num_kv_blocks=24, block_size=4)
    draft = await start_draft()
    gateway = await start_gateway(verifier.addr, draft.addr)
    try:
        prompts = PROMPTS[:6]
        expected = [reference_greedy(tokenizer(p)["input_ids"], 28) for p in prompts]
        results = await asyncio.gather(*[generate(gateway.addr, p, max_new_tokens=28, ignore_eos=True,
                                                  num_draft_tokens=3) for p in prompts])
        assert [ids for ids, _, _ in results] == expected
        assert verifier.engine.scheduler.num_preemptions > 0
        await wait_blocks_free(verifier)
        assert verifier.engine.block_manager.num_free_blocks == 24
    finally:
        for running in (gateway, draft, verifier):
            await running.stop()


async def test_chunked_prefill_and_prefix_sharing(tokenizer) -> None:
    """A prompt longer than the token budget is prefilled in chunks; a repeated prompt reuses cached blocks."""
    verifier = await start_verifier(max_num_batched_tokens=8, block_size=4)
    gateway = await start_gateway(verifier.addr, "")
    try:
        prompt = PROMPTS[5] + " " + PROMPTS[3]
        expected = reference_greedy(tokenizer(prompt)["input_ids"], 12)
        steps_before = verifier.engine.num_steps
        ids, _, _ = await generate(gateway.addr, prompt, max_new_tokens=12, ignore_eos=True)
        assert ids == expected
        assert verifier.engine.num_steps - steps_before > len(tokenizer(prompt)["input_ids"]) // 8
        async with grpc.aio.insecure_channel(verifier.addr) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            reply = await stub.StartSession(verifier_pb2.StartSessionRequest(
                session_id="again", prompt_token_ids=tokenizer(prompt)["input_ids"]))
            assert reply.num_cached_prompt_tokens >= 4 * ((len(tokenizer(prompt)["input_ids"]) - 1) // 4) - 4
            assert reply.first_token_id == expected[0]
        ids, _, _ = await generate(gateway.addr, prompt, max_new_tokens=12, ignore_eos=True)
        assert ids == expected
    finally:
        for running in (gateway, verifier):
            await running.stop()


def handle_posted(engine, count: int) -> None:
    """With the engine thread stopped: handle the next `count` posted messages here, in order."""
    for _ in range(count):
        engine.handle(engine._inbox.get_nowait())


async def test_admission_control() -> None:
    """A full queue answers RESOURCE_EXHAUSTED at once; a prompt larger than the whole pool fails the same way."""
    verifier = await start_verifier(num_kv_blocks=4, block_size=4, max_queue_len=2)
    engine = verifier.engine
    try:
        engine.stop()                               # freeze the engine thread: queue items stay queued
        params = SamplingParams()
        done = [engine.start_session(f"s{i}", [1, 2, 3], params) for i in range(3)]
        handle_posted(engine, 3)
        with pytest.raises(EngineError) as info:
            await done[2].future
        assert info.value.code == "RESOURCE_EXHAUSTED"
        engine.scheduler.clear()
        engine.sessions.clear()
        big = engine.start_session("big", list(range(5, 40)), params)
        handle_posted(engine, 1)
        engine.step()
        with pytest.raises(EngineError) as info:
            await big.future
        assert info.value.code == "RESOURCE_EXHAUSTED" and "does not fit" in str(info.value)
        assert engine.block_manager.num_free_blocks == 4
    finally:
        await verifier.server.stop(0)


async def test_gateway_maps_resource_exhausted() -> None:
    verifier = await start_verifier(num_kv_blocks=4, block_size=4)
    gateway = await start_gateway(verifier.addr, "")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(gateway.addr, PROMPTS[5], max_new_tokens=4)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        ids, _, _ = await generate(gateway.addr, "a", max_new_tokens=4, ignore_eos=True)  # still serving
        assert len(ids) == 4
    finally:
        for running in (gateway, verifier):
            await running.stop()


async def test_expired_work_is_dropped_from_the_batch() -> None:
    """Work whose caller's deadline passed while it waited is failed with DEADLINE_EXCEEDED, not computed."""
    verifier = await start_verifier()
    engine = verifier.engine
    try:
        engine.stop()                               # freeze the engine thread: run its steps by hand
        params = SamplingParams()
        expired = engine.start_session("late", [1, 2, 3], params, deadline=time.monotonic() - 1)
        alive = engine.start_session("on-time", [1, 2, 3], params, deadline=time.monotonic() + 60)
        handle_posted(engine, 2)
        steps = engine.num_steps
        engine.step()
        with pytest.raises(EngineError) as info:
            await expired.future
        assert info.value.code == "DEADLINE_EXCEEDED"
        assert (await alive.future).token_ids                  # the other session ran in the same step
        assert engine.num_steps == steps + 1 and "late" not in engine.sessions
    finally:
        await verifier.server.stop(0)


async def test_verify_reports_the_batch_it_ran_in() -> None:
    """Two sessions verified in one forward both see its total tokens (the load the adaptive draft length reads)."""
    verifier = await start_verifier()
    engine = verifier.engine
    try:
        engine.stop()                               # freeze the engine thread: run its steps by hand
        params = SamplingParams()
        starts = [engine.start_session(f"load{i}", [1, 2, 3, 4 + i], params) for i in range(2)]
        handle_posted(engine, 2)
        engine.step()
        firsts = [(await s.future).token_ids[0] for s in starts]
        verifies = [engine.verify(f"load{i}", [7] * (i + 2), None) for i in range(2)]
        handle_posted(engine, 2)
        engine.step()
        results = [await v.future for v in verifies]
        assert [r.num_batch_tokens for r in results] == [(1 + 2) + (1 + 3)] * 2   # last token + drafts, each
        assert all(r.num_waiting == 0 for r in results) and len(firsts) == 2
    finally:
        await verifier.server.stop(0)


async def test_more_drafts_than_the_step_budget_is_invalid_argument() -> None:
    """Issue 12: a Verify whose pending token + drafts exceed max_num_batched_tokens is refused at once (it used to
    loop forever or fail the whole engine); one that just fits runs, and the session goes on."""
    verifier = await start_verifier(max_num_batched_tokens=16)
    engine = verifier.engine
    try:
        params = SamplingParams()
        first = (await engine.start_session("s", list(range(1, 40)), params).future).token_ids[0]
        with pytest.raises(EngineError) as info:
            await engine.verify("s", [5] * 16, None).future
        assert info.value.code == "INVALID_ARGUMENT" and "max_num_batched_tokens=16" in str(info.value)
        result = await engine.verify("s", [first] + [5] * 14, None).future     # 15 drafts + pending = 16 tokens
        assert result.num_accepted <= 15 and result.token_ids
        assert "s" in engine.sessions and not engine.sessions["s"].busy
        engine.end_session("s")
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()


async def test_a_fault_while_finishing_one_request_fails_only_that_request() -> None:
    """A bug hit while finishing one session's verify fails that call with INTERNAL; its batch-mates and the
    requests still queued are answered as usual."""
    verifier = await start_verifier()
    engine = verifier.engine
    try:
        engine.stop()                               # freeze the engine thread: run its steps by hand
        params = SamplingParams()
        starts = [engine.start_session(f"f{i}", [1, 2, 3, 4 + i], params) for i in range(3)]
        handle_posted(engine, 3)
        engine.step()
        firsts = [(await s.future).token_ids[0] for s in starts]
        real_sample = engine._sample

        def sample(req, session, *args):
            if session.session_id == "f1":
                raise RuntimeError("boom")
            return real_sample(req, session, *args)

        engine._sample = sample
        verifies = [engine.verify(f"f{i}", [7, 8], None) for i in range(3)]
        handle_posted(engine, 3)
        engine.step()
        with pytest.raises(EngineError) as info:
            await verifies[1].future
        assert info.value.code == "INTERNAL" and "boom" in str(info.value)
        assert [len((await verifies[i].future).token_ids) > 0 for i in (0, 2)] == [True, True]
        assert "f1" not in engine.sessions and {"f0", "f2"} <= set(engine.sessions)
        assert len(firsts) == 3
    finally:
        await verifier.server.stop(0)


async def test_a_forward_crash_fails_its_batch_not_the_queue() -> None:
    verifier = await start_verifier(max_num_seqs=1)
    engine = verifier.engine
    try:
        engine.stop()                               # freeze the engine thread: run its steps by hand
        params = SamplingParams()
        starts = [engine.start_session(f"c{i}", [1, 2, 3, 4 + i], params) for i in range(2)]
        handle_posted(engine, 2)
        real_forward = engine.runner.forward_flat
        engine.runner.forward_flat = lambda items: (_ for _ in ()).throw(RuntimeError("device lost"))
        engine.step()                               # one sequence per step: c0 runs (and crashes), c1 waits
        engine.runner.forward_flat = real_forward
        with pytest.raises(EngineError) as info:
            await starts[0].future
        assert info.value.code == "INTERNAL" and "device lost" in str(info.value)
        engine.step()
        assert (await starts[1].future).token_ids
        assert engine.block_manager.num_used_blocks == 1 and list(engine.sessions) == ["c1"]
    finally:
        await verifier.server.stop(0)
