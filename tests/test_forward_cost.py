"""The verifier's measure of one more token's cost (VerifyResponse.token_cost) and how the gateway prices drafts
with it: a verifier whose extra tokens are expensive (AVX2 without VNNI: ~0.4 of a one-token forward each) must not
be sent long drafts that a cheap one (~0.05) would take."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from gateway.adaptive import DraftLengthController
from gateway.suffix_choice import LOCAL, NONE, ProposerChoice
from gateway.suffix_tree import Proposal
from gateway.verify_cost import VerifyCost
from protos.specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from specmesh.engine.forward_cost import MAX_TOKENS, ForwardCost
from tests.stack import Running, start_verifier


def feed(cost: ForwardCost, one_token_s: float, token_cost: float, threads: int = 1, rounds: int = 40) -> None:
    """Forwards of 1 token (decoding ahead) and of 3-6 tokens (verifies) with t(n) = t1 * (1 + c * (n - 1))."""
    for i in range(rounds):
        n = 1 if i % 2 else 3 + i % 4
        cost.observe(n, threads, one_token_s * (1 + token_cost * (n - 1)))


@pytest.mark.parametrize("token_cost", [0.05, 0.4])
def test_the_line_recovers_the_cost_of_one_more_token(token_cost: float) -> None:
    cost = ForwardCost()
    feed(cost, 0.116, token_cost)
    assert cost.token_cost(1) == pytest.approx(token_cost, rel=1e-6)


def test_unknown_until_the_forwards_differ_in_size_and_kept_per_thread_count() -> None:
    cost = ForwardCost()
    for _ in range(20):
        cost.observe(1, 2, 0.075)
    assert cost.token_cost(2) == 0.0                  # only one-token forwards: no slope yet
    assert cost.token_cost(1) == 0.0                  # never seen at one thread
    feed(cost, 0.116, 0.4, threads=1)
    feed(cost, 0.075, 0.3, threads=2)
    assert cost.token_cost(1) == pytest.approx(0.4, rel=1e-3)
    assert cost.token_cost(2) == pytest.approx(0.3, rel=0.05)


@pytest.mark.parametrize("free_tokens", [1, 2, 4, 8])
def test_the_free_tokens_are_found_from_the_forwards(free_tokens: int) -> None:
    """Memory-bound int4 on a full-width AVX2 core: a forward of up to 4 tokens costs what one does,
    t(n) = t1 * (1 + c * max(0, n - F)); the fit finds F and c (with a little noise on every forward)."""
    cost = ForwardCost()
    for i in range(80):
        n = 1 + (i * 5) % 12
        cost.observe(n, 1, 0.1 * (1 + 0.2 * max(0, n - free_tokens)) * (1 + 0.01 * ((i * 7) % 3 - 1)))
    assert cost.fit(1).free_tokens == free_tokens
    assert cost.token_cost(1) == pytest.approx(0.2, rel=0.05)


def test_the_draft_length_fills_the_free_tokens() -> None:
    """1.5B int4 on AVX2: a verify of up to 4 tokens costs what one does, each beyond ~0.4 more. With acceptance 0.7
    and cheap drafts that makes k = 3 (4 tokens) best; priced per token from the first (F = 1) it would be k = 1."""
    ks = {}
    for free in (1, 4):
        ctrl = DraftLengthController(min_k=0, max_k=8, initial_k=4)
        for i in range(80):
            k = ctrl.next_k()
            ctrl.observe_verify_cost(VerifyCost(0.4, free))
            accepted = next((j for j in range(k) if (i * 7 + j * 3) % 10 >= 7), k)      # ~0.7 per position
            ctrl.observe(k, accepted, draft_s=0.01 * k, verify_s=0.1 * (1 + 0.4 * max(0, k + 1 - free)))
        ks[free] = ctrl.k
    assert ks == {1: 1, 4: 3}


def test_the_choice_prices_drafts_within_the_free_tokens_at_a_one_token_verify() -> None:
    choice = ProposerChoice()
    for _ in range(30):
        choice.observe_verify(3, 0.1, VerifyCost(0.4, 4))
    assert choice.verify_s(0) == pytest.approx(0.1, rel=0.01) and choice.verify_s(3) == choice.verify_s(0)
    assert choice.verify_s(4) == pytest.approx(0.14, rel=0.01)
    choice.observe_cost(LOCAL, 0.0001)
    assert choice.choose({LOCAL: (0.5, 3)}) == LOCAL     # half a token expected, for free
    assert choice.choose({LOCAL: (0.5, 5)}) == NONE      # ... not worth 0.8 of a forward


def test_a_suffix_proposal_is_cut_where_its_unlikely_tail_costs_more_than_it_brings() -> None:
    proposal = Proposal(list(range(10, 20)), list(range(-1, 9)), [0.9, 0.85, 0.8, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1])
    dear, cheap = ProposerChoice(), ProposerChoice()
    for choice, cost in ((dear, VerifyCost(0.4, 4)), (cheap, VerifyCost(0.01, 4))):
        for _ in range(30):
            choice.observe_verify(3, 0.1, cost)
            choice.observe_cost(LOCAL, 0.0001)
    assert dear.trimmed(LOCAL, proposal) == proposal.prefix(3)          # the free tokens, no more
    assert cheap.trimmed(LOCAL, proposal) == proposal                   # cheap tokens: the whole chain pays


def test_prefills_do_not_tilt_the_line() -> None:
    cost = ForwardCost()
    feed(cost, 0.1, 0.05)
    for n in (100, 400, 1000):                         # compute-bound prompts: 10 ms a token
        cost.observe(n, 1, 0.01 * n)
    assert n > MAX_TOKENS and cost.token_cost(1) == pytest.approx(0.05, rel=1e-6)


def test_the_choice_takes_target_only_over_a_half_right_suffix_draft_on_an_expensive_verifier() -> None:
    """3 drafted tokens expected to give 1 accepted: worth it where a token costs 0.05 of a forward, not at 0.6."""
    options = {LOCAL: (1.0, 3)}
    cheap, dear = ProposerChoice(), ProposerChoice()
    for choice, token_cost in ((cheap, 0.05), (dear, 0.6)):
        for _ in range(30):
            choice.observe_cost(LOCAL, 0.0001)
            choice.observe_verify(3, 0.1 * (1 + token_cost * 3), VerifyCost(token_cost))
        assert choice.verify_slope == token_cost
        assert choice.verify_s(3) == pytest.approx(0.1 * (1 + token_cost * 3), rel=0.01)   # the prior faded
    assert cheap.choose(dict(options)) == LOCAL
    assert dear.choose(dict(options)) == NONE


def test_the_draft_length_follows_the_verifiers_token_cost() -> None:
    """Same acceptance (0.6), same draft cost; rounds all at k = 4 (no spread to fit a slope from): the reported
    cost alone moves k."""
    ks = {}
    for token_cost in (0.02, 0.5):
        ctrl = DraftLengthController(min_k=1, max_k=8, initial_k=4)
        for i in range(60):
            ctrl.observe_verify_cost(VerifyCost(token_cost))
            accepted = 4 if i % 5 < 2 else i % 3      # ~0.6 per position
            ctrl.observe(4, accepted, draft_s=0.004, verify_s=0.1 * (1 + token_cost * 4))
            ctrl.next_k()
        ks[token_cost] = ctrl.k
    assert ks[0.5] < ks[0.02]


@contextlib.asynccontextmanager
async def verifier_with_forward_time(seconds: Callable[[int], float]) -> AsyncIterator[tuple[Running, Any]]:
    """An int8 tiny verifier whose every forward also sleeps seconds(tokens in the forward) (the tiny model's own
    time is overhead and noise, with no slope to find), and a stub to it. Its KV cache is float32 (not int8's half
    cache), as an unquantized draft's: the tests that draft with the target itself rely on near-total acceptance."""
    verifier = await start_verifier(dtype="int8", decode_ahead_tokens=0, kv_cache_dtype="float32")
    runner = verifier.engine.runner
    forward_flat = runner.forward_flat

    def slowed_forward_flat(items: list, *args: object, **kwargs: object) -> object:
        time.sleep(seconds(sum(len(item.token_ids) for item in items)))
        return forward_flat(items, *args, **kwargs)
    runner.forward_flat = slowed_forward_flat
    try:
        async with grpc.aio.insecure_channel(verifier.addr) as channel:
            yield verifier, verifier_pb2_grpc.VerifierStub(channel)
    finally:
        await verifier.stop()


async def test_a_verifier_reports_its_token_cost_once_its_forwards_differ_in_size() -> None:
    """Over gRPC: 0 while every forward had one token, then a positive cost once drafted verifies ran. Each forward
    of the tiny model takes 20 ms more per token."""
    async with verifier_with_forward_time(lambda n: 0.02 * n) as (verifier, stub):
        start = await stub.StartSession(verifier_pb2.StartSessionRequest(
            session_id="c", prompt_token_ids=list(range(5, 30)), max_new_tokens=200))
        replies = [await stub.Verify(verifier_pb2.VerifyRequest(session_id="c", owner_token=start.owner_token))
                   for _ in range(3)]
        assert [r.token_cost for r in replies] == [0.0, 0.0, 0.0]      # the prefill is not verify-sized
        for i in range(30):                                           # drafts of 0-5 tokens (some rejected)
            drafts = [7] * (i % 6)
            replies.append(await stub.Verify(verifier_pb2.VerifyRequest(
                session_id="c", owner_token=start.owner_token, draft_token_ids=drafts)))
        assert 0.5 < replies[-1].token_cost <= 1.0                     # t(n) ~ 20 ms * n + the model's
        assert replies[-1].free_tokens == 1
        assert replies[-1].token_cost == pytest.approx(verifier.engine.forward_cost.token_cost(1))


async def test_a_verifier_reports_the_tokens_its_forwards_take_for_the_price_of_one() -> None:
    """Each forward of the tiny model is made to cost 80 ms for up to 4 tokens and 30 ms more per token beyond (at 40
    and 15 ms a noisy 2-core host's stray 10-20 ms once made the fit see no free tokens)."""
    async with verifier_with_forward_time(lambda n: 0.08 + 0.03 * max(0, n - 4)) as (_, stub):
        start = await stub.StartSession(verifier_pb2.StartSessionRequest(
            session_id="f", prompt_token_ids=list(range(5, 30)), max_new_tokens=300))
        for i in range(40):                                           # drafts of 0-7 tokens
            reply = await stub.Verify(verifier_pb2.VerifyRequest(
                session_id="f", owner_token=start.owner_token, draft_token_ids=[7] * (i * 3 % 8)))
    assert reply.free_tokens == 4
    assert 0.2 < reply.token_cost < 0.6                                # 30 / 80 ms, plus the model's own time
