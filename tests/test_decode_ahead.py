"""Decoding ahead (verifier_service/ahead.py): an idle greedy session's verifier decodes the target's next tokens
while the caller drafts, and the next verify meets its drafts against them.

- On plain ints: which drafts the ahead tokens accept, when the verdict needs no forward, what is left to verify
  (chains and trees).
- On a real verifier (tiny model): the tokens decoded ahead are target-only greedy's; a verify leaves with all of
  them (no forward when a draft disagrees); drafts past them are verified from the last one; the ahead limit and
  the session's max_new_tokens bound it; blocks are freed at the end. Sampled sessions: test_decode_ahead_sampled.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from transformers import AutoTokenizer

from gateway.proposers.base import Draft
from gateway.round_loop import verify_request
from protos.specmesh.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specmesh.models import resolve_model_dir
from specmesh.spec.sampling import SamplingParams
from tests.stack import reference_greedy, start_verifier
from tests.test_e2e_greedy import PROMPTS, wait_blocks_free
from tests.test_paged_verifier import handle_posted
from verifier_service.ahead import match_ahead, subtree

A, B, C, D, E, X = 11, 12, 13, 14, 15, 99
# The int8 verifiers here keep a float32 KV cache: the tests wait for tokens decoded ahead, which stop at an end of
# sequence, and PROMPTS[3]'s int8 output has none in its first 68 tokens on a float32 cache (on int8's default half
# cache one comes at 32, and whether a guess step jumps past it depends on timing)
KV_CACHE = "float32"


# ---- plain ints ------------------------------------------------------------------------------------------------
def test_a_chain_rejected_at_an_ahead_token_is_settled_without_a_forward() -> None:
    match = match_ahead([A, B, C], [A, B, X, D], None)
    assert match.resolved and match.path == [0, 1]


def test_drafts_shorter_than_the_ahead_tokens_are_settled_too() -> None:
    assert match_ahead([A, B, C], [A], None).path == [0] and match_ahead([A, B, C], [A], None).resolved
    assert match_ahead([A], [], None).resolved and match_ahead([A], [], None).path == []


def test_drafts_past_every_ahead_token_are_left_to_verify() -> None:
    match = match_ahead([A, B], [A, B, C, D], None)
    assert not match.resolved and match.path == [0, 1]
    assert (match.rest_ids, match.rest_parents, match.rest_indices) == ([C, D], None, [2, 3])
    exact = match_ahead([A, B], [A, B], None)          # the target's token after B still needs a forward
    assert not exact.resolved and exact.rest_ids == [] and exact.path == [0, 1]


def test_trees_follow_the_ahead_tokens_down_one_path() -> None:
    #        root
    #       /    \
    #      A      B
    #      |     / \
    #      C    D   E
    #               |
    #               A
    token_ids, parents = [A, B, C, D, E, A], [-1, -1, 0, 1, 1, 4]
    assert subtree(parents, 1) == [3, 4, 5]
    below_b = match_ahead([B], token_ids, parents)
    assert not below_b.resolved and below_b.path == [1]
    assert (below_b.rest_ids, below_b.rest_parents, below_b.rest_indices) == ([D, E, A], [-1, -1, 1], [3, 4, 5])
    settled = match_ahead([B, E, X], token_ids, parents)
    assert settled.resolved and settled.path == [1, 4]
    assert match_ahead([X], token_ids, parents).path == [] and match_ahead([X], token_ids, parents).resolved


# ---- a real verifier -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))


async def wait_ahead(engine, session_id: str, num_tokens: int, timeout_s: float = 10.0) -> None:
    """Until the session holds `num_tokens` tokens (delivered + decoded ahead); then a moment more, to see it stop."""
    for _ in range(int(timeout_s / 0.01)):
        if len(engine.sessions[session_id].seq.token_ids) >= num_tokens:
            await asyncio.sleep(0.1)
            return
        await asyncio.sleep(0.01)
    s = engine.sessions[session_id]     # what held it back (a rare failure in the suite, not reproduced alone)
    raise AssertionError(f"the session never decoded ahead to {num_tokens} tokens: holds {len(s.seq.token_ids)} "
                         f"(last {s.seq.token_ids[-4:]}, eos {sorted(engine.ahead.eos_token_ids)}), delivered "
                         f"{s.num_delivered}, computed {s.seq.num_computed}, busy {s.busy}, drafting {s.drafting}")


async def test_verifies_leave_with_the_tokens_decoded_ahead_and_stay_exact(tokenizer) -> None:
    verifier = await start_verifier(dtype="int8", block_size=4, decode_ahead_tokens=5, kv_cache_dtype=KV_CACHE)
    engine = verifier.engine
    try:
        prompt_ids = tokenizer(PROMPTS[3])["input_ids"]
        n = len(prompt_ids)
        first = await engine.start_session("s", prompt_ids, SamplingParams(), max_new_tokens=30).future
        output = list(first.token_ids)
        await wait_ahead(engine, "s", n + 1 + 5)
        assert len(engine.sessions["s"].seq.token_ids) == n + 1 + 5           # the limit: 5 ahead, no more
        # A wrong second draft: settled by the tokens decoded ahead, no forward, and all five leave with it.
        engine.ahead.max_tokens = 0           # (so that no step decodes ahead again right after the answer)
        steps = engine.num_steps
        ahead = engine.sessions["s"].seq.token_ids[n + 1:]
        reply = await engine.verify("s", [ahead[0], X], None).future
        assert engine.num_steps == steps and reply.num_batch_tokens == 0
        engine.ahead.max_tokens = 5
        engine.post(None)                      # wake the engine thread to decode ahead again
        assert (reply.num_accepted, list(reply.accepted_node_indices), reply.token_ids) == (1, [0], ahead)
        output += reply.token_ids
        # Drafts past the tokens decoded ahead: the ones that match are accepted, the rest verified in a forward.
        await wait_ahead(engine, "s", n + len(output) + 5)
        ahead = engine.sessions["s"].seq.token_ids[n + len(output):]
        reply = await engine.verify("s", ahead + [X, X], None).future
        assert reply.num_accepted == 5 and reply.token_ids[:5] == ahead and len(reply.token_ids) == 6
        output += reply.token_ids
        while len(output) < 30:
            output += (await engine.verify("s", [], None).future).token_ids
        # int8 speculation is exact against the same engine decoding one token per forward (no drafts, no ahead)
        assert output == await target_only(prompt_ids, 30)
        await wait_ahead(engine, "s", n + 30)
        assert len(engine.sessions["s"].seq.token_ids) == n + 30                # never past max_new_tokens
        assert engine.ahead.counts.delivered >= 10
        assert ahead_metric(engine, "delivered") == engine.ahead.counts.delivered
        engine.end_session("s")
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()


def ahead_metric(engine, outcome: str) -> float | None:
    """specmesh_verifier_ahead_tokens_total{outcome=...} as the verifier's /metrics exports it."""
    return engine.metrics.registry.get_sample_value("specmesh_verifier_ahead_tokens_total", {"outcome": outcome})


async def target_only(prompt_ids: list[int], n: int, params: SamplingParams | None = None) -> list[int]:
    verifier = await start_verifier(dtype="int8", block_size=4, decode_ahead_tokens=0, kv_cache_dtype=KV_CACHE)
    try:
        engine = verifier.engine
        output = list((await engine.start_session("t", prompt_ids, params or SamplingParams()).future).token_ids)
        while len(output) < n:
            output += (await engine.verify("t", [], None).future).token_ids
        return output[:n]
    finally:
        await verifier.stop()


async def test_float32_tokens_decoded_ahead_are_transformers_greedy(tokenizer) -> None:
    verifier = await start_verifier(decode_ahead_tokens=8)
    engine = verifier.engine
    try:
        prompt_ids = tokenizer(PROMPTS[3])["input_ids"]
        expected = reference_greedy(prompt_ids, 24)
        assert not set(expected) & engine.eos_token_ids          # (decoding ahead stops at an end of sequence)
        output = list((await engine.start_session("f", prompt_ids, SamplingParams(), max_new_tokens=24).future)
                      .token_ids)
        while len(output) < 24:
            await wait_ahead(engine, "f", len(prompt_ids) + len(output) + 1)
            output += (await engine.verify("f", [], None).future).token_ids
        assert output == expected and engine.ahead.counts.delivered >= 23
        engine.end_session("f")
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()


async def test_an_ahead_step_gives_way_and_decoding_stays_exact(tokenizer) -> None:
    """A step that only decodes ahead, told to give way before its first layer, leaves no trace: no token, its KV
    slot dropped, and the next verify runs and decodes ahead as before."""
    verifier = await start_verifier(dtype="int8", block_size=4, decode_ahead_tokens=3, kv_cache_dtype=KV_CACHE)
    engine = verifier.engine
    try:
        prompt_ids = tokenizer(PROMPTS[3])["input_ids"]
        n = len(prompt_ids)
        engine.ahead.max_tokens = 0            # nothing ahead before the flag below is up
        output = list((await engine.start_session("i", prompt_ids, SamplingParams(), max_new_tokens=12).future)
                      .token_ids)
        engine._urgent_ids.add("i")            # as if its verify needing a forward had just arrived, until one does
        engine.ahead.max_tokens = 3
        engine.post(None)                      # wake the engine thread (no message: the flag stays up)
        await asyncio.sleep(0.3)
        interrupted = ahead_metric(engine, "interrupted")
        assert interrupted and interrupted > 0
        assert engine.ahead.counts.decoded == 0 and len(engine.sessions["i"].seq.token_ids) == n + 1
        output += (await engine.verify("i", [], None).future).token_ids      # a message: the flag is down
        await wait_ahead(engine, "i", n + len(output) + 1)                     # and decoding ahead resumes
        while len(output) < 12:
            output += (await engine.verify("i", [], None).future).token_ids
        assert output == await target_only(prompt_ids, 12)
        engine.end_session("i")
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()


async def test_an_ahead_step_beside_other_sessions_rows_runs_on(tokenizer) -> None:
    """A verify of one session does not throw away a step that decodes ahead for another session too: both get
    their tokens (no step given way). Once every session of such a step has a verify waiting, it gives way."""
    verifier = await start_verifier(dtype="int8", block_size=4, decode_ahead_tokens=3, kv_cache_dtype=KV_CACHE)
    engine = verifier.engine
    try:
        engine.ahead.max_tokens = 0
        lengths = {}
        for session_id, prompt in (("i", PROMPTS[3]), ("j", PROMPTS[0])):
            prompt_ids = tokenizer(prompt)["input_ids"]
            await engine.start_session(session_id, prompt_ids, SamplingParams(), max_new_tokens=12).future
            lengths[session_id] = len(prompt_ids) + 1
        engine._urgent_ids.add("i")            # i's verify needing a forward has arrived; j's has not
        engine.ahead.max_tokens = 3
        engine.post(None)
        for session_id, n in lengths.items():
            await wait_ahead(engine, session_id, n + 3)
        assert not ahead_metric(engine, "interrupted") and engine.ahead.counts.decoded == 6
        engine.ahead.max_tokens = 0
        for session_id in lengths:             # both deliver what they decoded ahead: nothing gave way
            assert len((await engine.verify(session_id, [], None).future).token_ids) == 3
        engine._urgent_ids.update(("i", "j"))  # now both: the step gives way before its first layer
        engine.ahead.max_tokens = 6
        engine.post(None)
        await asyncio.sleep(0.3)
        assert (ahead_metric(engine, "interrupted") or 0) > 0 and engine.ahead.counts.decoded == 6
        for session_id in lengths:
            engine.end_session(session_id)
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()


async def test_only_the_draft_models_blocks_leave_its_core_to_the_draft_service(tokenizer) -> None:
    """On a host shared with the draft service, a step that decodes ahead after a verify of the draft model's block
    keeps to the ahead threads (the service is likely drafting the next block); after n-gram or cache drafts (no
    model runs) it uses every thread the verifier has, as between rounds without drafts."""
    verifier = await start_verifier(decode_ahead_tokens=2, num_threads_max=2, max_threads_min_tokens=1)
    engine = verifier.engine
    engine.ahead.threads = 1
    try:
        prompt_ids = tokenizer(PROMPTS[3])["input_ids"]
        output = list((await engine.start_session("s", prompt_ids, SamplingParams(), max_new_tokens=40).future)
                      .token_ids)
        for model_drafts, threads in ((False, 2), (True, 1), (False, 2)):
            await wait_ahead(engine, "s", len(prompt_ids) + len(output) + 2)
            reply = await engine.verify("s", [X, X, X, X], None, model_drafts=model_drafts).future  # past the ahead
            output += reply.token_ids
            assert engine.sessions["s"].drafting is model_drafts
            await wait_ahead(engine, "s", len(prompt_ids) + len(output) + 2)
            assert engine.forward_threads == threads, model_drafts
        engine.end_session("s")
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()


async def test_a_session_drafting_with_the_model_leaves_the_cores_to_the_draft_service(tokenizer) -> None:
    """With decode_ahead_beside_drafts off (the draft service on the verifier's cores, as `specmesh up` runs it), a
    session whose last or second-to-last verify carried the draft model's block decodes nothing ahead (its caller is
    likely drafting with the model: model rounds alternate with n-gram rounds); two verifies of n-gram or cache
    drafts (no model runs) later it decodes ahead as before. Its output stays target-only greedy's."""
    verifier = await start_verifier(decode_ahead_tokens=2)
    engine = verifier.engine
    engine.ahead.beside_drafts = False
    try:
        prompt_ids = tokenizer(PROMPTS[3])["input_ids"]
        output = list((await engine.start_session("s", prompt_ids, SamplingParams(), max_new_tokens=40).future)
                      .token_ids)
        await wait_ahead(engine, "s", len(prompt_ids) + len(output) + 2)
        for model_drafts, decodes_ahead in ((True, False), (False, False), (False, True), (True, False)):
            output += (await engine.verify("s", [X, X, X, X], None, model_drafts=model_drafts).future).token_ids
            if decodes_ahead:
                await wait_ahead(engine, "s", len(prompt_ids) + len(output) + 2)
            else:
                await asyncio.sleep(0.3)                     # nothing decoded ahead while the caller drafts
                assert len(engine.sessions["s"].seq.token_ids) == len(prompt_ids) + len(output), model_drafts
        assert output == reference_greedy(prompt_ids, len(output))
        engine.end_session("s")
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()


async def test_idle_sessions_decode_ahead_in_the_forward_of_a_waiting_verify(tokenizer) -> None:
    """A verify that needs a forward does not run alone while another session idles: the idle session's next token
    is decoded ahead in the same forward (held back, 7 idle streams of 8 lost a forward to every such verify)."""
    verifier = await start_verifier(decode_ahead_tokens=3)
    engine = verifier.engine
    try:
        engine.stop()                               # run the steps by hand
        starts = [engine.start_session(s, tokenizer(p)["input_ids"], SamplingParams(), max_new_tokens=12)
                  for s, p in (("a", PROMPTS[3]), ("b", PROMPTS[0]))]
        handle_posted(engine, 2)
        engine.step()
        firsts = [(await s.future).token_ids for s in starts]
        b_len = len(engine.sessions["b"].seq.token_ids)
        verify = engine.verify("a", [X, X], None)
        handle_posted(engine, 1)
        engine.step()
        result = await verify.future
        assert result.num_batch_tokens == 3 + 1                 # a's pending token and 2 drafts, b's row beside
        assert len(engine.sessions["b"].seq.token_ids) == b_len + 1
        settled = engine.verify("b", [], None)
        handle_posted(engine, 1)
        reply = await settled.future                           # settled by the token decoded ahead
        assert reply.num_batch_tokens == 0 and len(reply.token_ids) == 1
        prompt_b = tokenizer(PROMPTS[0])["input_ids"]
        assert [*firsts[1], *reply.token_ids] == reference_greedy(prompt_b, 2)
    finally:
        await verifier.server.stop(0)


async def test_a_verify_says_where_its_drafts_came_from() -> None:
    """VerifyRequest.draft_source: the draft model's block (or drafts from a gateway that does not say) marks the
    session as drafting; n-gram and cache drafts do not."""
    verifier = await start_verifier()
    try:
        async with grpc.aio.insecure_channel(verifier.addr) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            start = await stub.StartSession(verifier_pb2.StartSessionRequest(session_id="s", prompt_token_ids=[5, 6]))
            sources = ((common_pb2.DRAFT_SOURCE_NGRAM, False), (common_pb2.DRAFT_SOURCE_MODEL, True),
                       (common_pb2.DRAFT_SOURCE_CACHE, False), (common_pb2.DRAFT_SOURCE_UNSPECIFIED, True))
            for source, drafting in sources:
                await stub.Verify(verifier_pb2.VerifyRequest(session_id="s", owner_token=start.owner_token,
                                                             draft_token_ids=[X], draft_source=source))
                assert verifier.engine.sessions["s"].drafting is drafting, source
            await stub.EndSession(common_pb2.EndSessionRequest(session_id="s", owner_token=start.owner_token))
    finally:
        await verifier.stop()


def test_the_gateway_says_where_a_rounds_drafts_came_from() -> None:
    for source in (common_pb2.DRAFT_SOURCE_MODEL, common_pb2.DRAFT_SOURCE_NGRAM, common_pb2.DRAFT_SOURCE_CACHE):
        request = verify_request(Draft([A, B], None, source))
        assert request.draft_source == source and list(request.draft_token_ids) == [A, B]
    tree = verify_request(Draft([A, B, C], None, common_pb2.DRAFT_SOURCE_MODEL, parents=[-1, -1, 0]))
    assert list(tree.draft_parents) == [-1, -1, 0]


async def test_a_verify_settled_ahead_reports_the_cost_of_the_threads_a_verify_runs_on(tokenizer) -> None:
    """`specmesh up` runs every step of the verifier on both cores (num_threads 1, num_threads_max 2, from 1 token):
    a verify settled by tokens decoded ahead, with no forward, reports the cost measured on those 2 threads (what
    the gateway prices its next draft by), not on the 1 thread no verify runs on."""
    verifier = await start_verifier(decode_ahead_tokens=3, num_threads_max=2, max_threads_min_tokens=1)
    engine = verifier.engine
    try:
        for n in (1, 2, 4, 8, 12):          # a measured line on 2 threads (steps here are all one token)
            engine.forward_cost.observe(n, 2, 0.01 + 0.002 * n)
        prompt_ids = tokenizer(PROMPTS[3])["input_ids"]
        await engine.start_session("s", prompt_ids, SamplingParams(), max_new_tokens=20).future
        await wait_ahead(engine, "s", len(prompt_ids) + 1 + 3)
        engine.ahead.max_tokens = 0
        ahead = engine.sessions["s"].seq.token_ids[len(prompt_ids) + 1:]
        reply = await engine.verify("s", [ahead[0], X], None).future
        assert reply.num_batch_tokens == 0                     # settled without a forward
        assert reply.cost == engine.forward_cost.fit(2) and reply.cost.token_cost > 0
        engine.end_session("s")
    finally:
        await verifier.stop()
