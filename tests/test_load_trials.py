"""Exploration that knows the load (issue 27): under load the suffix choice makes no trial or probe of a proposer
whose round could not beat target-only even at its best (gateway/suffix_choice.py `could_pay`), nor alone where the
draft service shares the verifier's cores; alone on a host of its own it always tries the draft model; and a
request's first round is priced with the load the verifier reported with the prefill (StartSessionResponse's cost
and load fields, gateway/proposers/cost_model.py `observe_start`); what a report's load is (gateway/verify_cost.py
`reported`)."""

from __future__ import annotations

import asyncio
import time

import grpc

from gateway.proposers.base import NO_DRAFT, Draft
from gateway.proposers.cost_model import RoundCostModel
from gateway.replicas import VerifierPool
from gateway.round_loop import Generation
from gateway.suffix_choice import LOCAL, MODEL, NONE, PROBE_BUDGET, PROBE_EVERY, ProposerChoice
from gateway.validation import GenerationParams
from gateway.verifier_session import SessionLost
from gateway.verify_cost import VerifyCost, load_penalty, reported
from protos.specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from specmesh.spec.sampling import SamplingParams
from tests.stack import start_verifier
from tests.test_paged_verifier import handle_posted

S = 0.25                       # compute-bound verifier: each row a quarter of a one-row forward more


def measured(other_rows: int, model_s: float | None = 0.3, slope: float = S,
             draft_host_share: float = 0.0) -> ProposerChoice:
    """A choice that verified 30 rounds of one token in 0.1 s beside `other_rows` target-only rows, and whose draft
    model rounds took `model_s` (the cost a request starts from, learned priors or its own first round; None: not
    measured yet)."""
    choice = ProposerChoice(draft_host_share)
    for _ in range(30):
        choice.observe_verify(0, 0.1, VerifyCost(slope, 1, other_rows + 1, other_rows, other_rows))
    if model_s is not None:
        choice.observe_cost(MODEL, model_s)
    return choice


def test_alone_on_a_host_of_its_own_the_model_gets_its_trials_whatever_the_measured_cost() -> None:
    """One stream, the draft service on its own host: the trials measure this request's acceptance, even when a
    noisy slope (a tiny model's milliseconds: 2.0) makes every draft look dear."""
    for slope in (S, 2.0):
        choice = measured(0, slope=slope)
        options = {MODEL: (choice.expected_model(4), 4)}
        assert choice.could_pay(MODEL, 4)
        assert choice.choose(options) == MODEL


def test_alone_on_the_verifiers_cores_a_model_that_could_not_pay_gets_no_trial() -> None:
    """The draft on the verifier's cores (`draft_host_share` 0.5, as on a 2-core host): alone too, a model whose
    round could not beat target-only even at 0.9 acceptance (0.3 s for 4 drafts beside 0.1 s target-only rounds,
    each extra row a quarter of a forward: 4.1 tokens in 0.5 s against 10 a second) gets no trial; a fast one (1 ms)
    does, and so does one not measured yet (free until its first round)."""
    for model_s, trial in ((0.3, NONE), (0.001, MODEL), (None, MODEL)):
        choice = measured(0, model_s=model_s, draft_host_share=0.5)
        assert choice.load.load_penalty(0) == 0
        assert choice.could_pay(MODEL, 4) == (trial == MODEL)
        assert choice.choose({MODEL: (choice.expected_model(4), 4)}) == trial, model_s


def test_beside_busy_rows_a_slow_model_gets_no_trial_a_fast_one_does() -> None:
    """3 target-only rows in every forward: 5 more rows take 2.5 tokens from them, so a model round of 4 drafts
    costing 0.3 s cannot beat a 0.1 s target-only round even at 0.9 acceptance; at 1 ms it still could."""
    slow, fast = measured(3), measured(3, model_s=0.001)
    assert slow.load.load_penalty(0) > 0
    assert not slow.could_pay(MODEL, 4)
    assert slow.choose({MODEL: (slow.expected_model(4), 4)}) == NONE
    assert fast.could_pay(MODEL, 4)


def test_under_load_a_proposer_that_could_not_pay_is_not_probed() -> None:
    """An 8-token suffix proposal expected to bring nothing is probed alone (its extra 0.2 s within the probe budget
    after 20 rounds), but not in 200 rounds beside 31 busy rows: even its best case takes more from them than it
    brings (the budget alone, which now counts those tokens, would allow a probe after ~100)."""
    for other_rows, num_rounds, probed in ((0, 2 * PROBE_EVERY, True), (31, 200, False)):
        choice = measured(other_rows)
        choice.observe_cost(LOCAL, 0.0001)
        picks = [choice.choose({LOCAL: (0.01, 8)}) for _ in range(num_rounds)]
        assert (LOCAL in picks) == probed, other_rows


def test_the_sessions_in_a_forward_share_one_probe_budget() -> None:
    """A one-token suffix proposal that could pay at its best but is expected to bring little: alone it is probed
    every PROBE_EVERY + 1 rounds; beside 7 busy rows its probes (each taking ~0.7 tokens from them) come about 8x
    less often, so the 8 sessions' probes together cost what one stream's would."""
    gaps = {}
    for other_rows in (0, 7):
        choice = measured(other_rows)
        choice.observe_cost(LOCAL, 0.0001)
        assert choice.could_pay(LOCAL, 1)
        picks = [choice.choose({LOCAL: (0.1, 1)}) for _ in range(400)]
        probes = [i for i, p in enumerate(picks) if p == LOCAL]
        gaps[other_rows] = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[0] and all(g == PROBE_EVERY + 1 for g in gaps[0]), gaps[0]
    assert gaps[7] and all(g >= 8 * (PROBE_EVERY + 1) * 0.5 for g in gaps[7]), gaps[7]
    assert measured(7).probe_budget() == PROBE_BUDGET / 8


def test_the_first_round_is_priced_with_the_load_the_prefill_saw() -> None:
    """Without the prefill's report a request starts as if alone and tries the slow model; with it (15 busy rows
    beside the prompt's last chunk) it does not."""
    for start, trial in ((None, MODEL), (VerifyCost(S, 1, 17, 15, 15), NONE)):
        choice = measured(0)
        choice.model.observe_load(0.0, 0.0)         # (a fresh request: nothing about the load yet)
        model = RoundCostModel(None, choice)
        if start is not None:
            model.observe_start(start)
        assert choice.choose({MODEL: (choice.expected_model(4), 4)}) == trial


async def test_start_session_reports_the_other_sessions_share_of_the_prefill_forward() -> None:
    """Over gRPC, two prompts prefilled in one forward: each answer names the other's rows and token, with the
    forward's measured cost, as a VerifyResponse does."""
    verifier = await start_verifier()
    engine = verifier.engine
    try:
        engine.stop()                               # freeze the engine thread: both starts share one step
        async with grpc.aio.insecure_channel(verifier.addr) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            calls = [asyncio.ensure_future(stub.StartSession(verifier_pb2.StartSessionRequest(
                session_id=f"load{i}", prompt_token_ids=[1, 2, 3, 4 + i, 5][:3 + 2 * i], max_new_tokens=8)))
                for i in range(2)]
            while engine._inbox.qsize() < 2:
                await asyncio.sleep(0.01)
            handle_posted(engine, 2)
            engine.step()
            first, second = [await c for c in calls]
        assert (first.num_batch_tokens, first.num_other_rows, first.num_other_tokens) == (8, 5, 1)
        assert (second.num_batch_tokens, second.num_other_rows, second.num_other_tokens) == (8, 3, 1)
        cost = reported(first.token_cost, first.free_tokens, first.num_batch_tokens, first.num_other_rows,
                        first.num_other_tokens, first.num_waiting)
        assert cost.other_rows >= 5 and cost.free_tokens >= 1
    finally:
        await verifier.server.stop(0)


def test_a_report_counts_every_session_and_every_row_of_the_others() -> None:
    """The load a verify reports: alone nothing; sessions away drafting still count (a row and a token each); a
    prompt chunk's rows are work the others need, a token's worth each, so drafts beside prefill are not cheap."""
    assert reported(0.2, 1, 1, 0, 0, 0, num_sessions=1) == VerifyCost(0.2, 1, 1, 0, 0)
    assert reported(0.2, 1, 2, 1, 1, 0, num_sessions=8) == VerifyCost(0.2, 1, 2, 7, 7)
    assert reported(0.2, 1, 0, 0, 0, 0, num_sessions=8) == VerifyCost(0.2, 1, 0, 0, 0)    # no forward: no sample
    prefill = reported(0.2, 1, 97, 92, 28, 0, num_sessions=16)                          # 16 prompts arriving
    assert (prefill.other_rows, prefill.other_tokens) == (92, 92)
    assert load_penalty(4, 92, 92, 0.2, 1) > 3 * load_penalty(4, 92, 28, 0.2, 1)


async def test_a_moved_session_prices_its_next_round_beside_the_new_replicas_sessions() -> None:
    """A failover's StartSession reports the new replica's load like the first one does: the round after the move
    is priced beside the 15 rows there, not with what the lost replica last reported."""
    choice = measured(0)
    choice.model.observe_load(0.0, 0.0)
    params = GenerationParams("r", [1, 2, 3], SamplingParams(), 8, (), 4, True)
    generation = Generation(params, "s", VerifierPool.of_stubs([]), None, 5.0, cost_model=RoundCostModel(None, choice))

    async def move(lost: SessionLost, context_ids: list[int], max_new_tokens: int, num_emitted: int):
        return verifier_pb2.StartSessionResponse(first_token_id=7, token_cost=S, free_tokens=1, num_batch_tokens=17,
                                                 num_other_rows=15, num_other_tokens=15, num_sessions=16)
    generation.session.move = move                   # type: ignore[method-assign]
    assert choice.choose({MODEL: (choice.expected_model(4), 4)}) == MODEL      # as if alone
    await generation._move(SessionLost("unavailable", "killed"))
    assert choice.load.load_penalty(0) > 0
    assert choice.choose({MODEL: (choice.expected_model(4), 4)}) == NONE


class CountingDrafter:
    """A drafter that counts its prefills, started and done, and what each proposal found of them."""

    def __init__(self, prefill_s: float) -> None:
        self.prefill_s = prefill_s
        self.prefills_started = self.prefills_done = 0
        self.proposals: list[tuple[int, int]] = []     # (prefills started, prefills done) at each proposal

    async def prefill(self, prompt_ids: list[int], num_tokens: int) -> None:
        self.prefills_started += 1
        await asyncio.sleep(self.prefill_s)
        self.prefills_done += 1

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        self.proposals.append((self.prefills_started, self.prefills_done))
        return NO_DRAFT

    async def close(self) -> None: ...


async def prefills_made(num_other_requests: int, start: verifier_pb2.StartSessionResponse,
                        model_s: float | None = 0.3, prefill_s: float = 0.0, arrived_alone: bool = False,
                        draft_host_share: float = 0.0,
                        verifier_prefill_s: float = 0.0) -> tuple[int, list[tuple[int, int]]]:
    """A generation's prefill beside `num_other_requests` requests (`arrived_alone`: they started while its verifier
    prefilled), its verifier answering `start` after `verifier_prefill_s`, then its first proposal: (draft prefills
    made, (started, done) at each proposal)."""
    choice = measured(0, model_s=model_s, draft_host_share=draft_host_share)
    choice.model.observe_load(0.0, 0.0)
    drafter = CountingDrafter(prefill_s)
    params = GenerationParams("r", [1, 2, 3], SamplingParams(), 8, (), 4, True)
    generation = Generation(params, "s", VerifierPool.of_stubs([]), drafter, 5.0,  # type: ignore[arg-type]
                            cost_model=RoundCostModel(None, choice), other_requests=lambda: running)
    running = 0 if arrived_alone else num_other_requests

    async def open_session(prompt_ids: list[int], max_new_tokens: int) -> verifier_pb2.StartSessionResponse:
        nonlocal running
        await asyncio.sleep(verifier_prefill_s)
        running = num_other_requests
        return start
    generation.session.open = open_session          # type: ignore[method-assign]
    await generation._prefill()
    await asyncio.sleep(0)                          # the prefill task starts
    await generation._propose([1, 2, 3, 7], 4, 4)
    await generation.close()
    return drafter.prefills_started, drafter.proposals


async def test_the_draft_service_prefills_only_where_its_model_could_pay() -> None:
    """Alone, the draft service prefills after the verifier; beside other requests only if a model round could pay
    under the load the verifier reported (15 busy rows and a 0.3 s model: it could not, so no prefill; an idle
    replica, or a fast model beside 3 rows: the prefill is made)."""
    busy = verifier_pb2.StartSessionResponse(first_token_id=7, token_cost=S, free_tokens=1, num_batch_tokens=17,
                                             num_other_rows=15, num_other_tokens=15, num_sessions=16)
    idle = verifier_pb2.StartSessionResponse(first_token_id=7, token_cost=S, free_tokens=1, num_batch_tokens=3,
                                             num_sessions=1)
    assert (await prefills_made(0, busy))[0] == 1           # alone at this gateway: made, whatever the replica
    assert (await prefills_made(3, busy))[0] == 0
    assert (await prefills_made(3, idle))[0] == 1
    light = verifier_pb2.StartSessionResponse(first_token_id=7, token_cost=S, free_tokens=1, num_batch_tokens=5,
                                              num_other_rows=3, num_other_tokens=3, num_sessions=4)
    assert (await prefills_made(3, light, model_s=0.001))[0] == 1       # a fast model could pay beside 3 rows
    assert (await prefills_made(3, light))[0] == 0


async def test_alone_on_the_verifiers_cores_the_draft_prefills_only_where_its_model_could_pay() -> None:
    """With the draft service on the verifier's cores, a request alone makes the draft prefill only if a model
    round could pay at its best: the prefill would take a core from the verifier's forwards for a model that is not
    going to be chosen (a 0.3 s model beside 0.1 s rounds); a fast one's is made."""
    idle = verifier_pb2.StartSessionResponse(first_token_id=7, token_cost=S, free_tokens=1, num_batch_tokens=3,
                                             num_sessions=1)
    assert (await prefills_made(0, idle, draft_host_share=0.5))[0] == 0
    assert (await prefills_made(0, idle, model_s=0.001, draft_host_share=0.5))[0] == 1
    assert (await prefills_made(0, idle))[0] == 1                        # the draft on a host of its own


def test_on_the_verifiers_cores_a_draft_prefill_must_be_repaid_by_the_requests_tokens() -> None:
    """The draft on the verifier's cores: its prefill of a prompt takes the verifier's prefill time times the
    draft's cost per token over the target's from every forward meanwhile, so it is made only where the request's
    tokens could repay it with model rounds at their best. 0.1 s target-only rounds, 4 drafts at 0.9 acceptance
    verified in 0.2 s: at most ~51 ms saved a token, 4.9 s over 96 tokens. An unmeasured model is priced at a third
    of the target (a 31 s document prefill: 10.3 s, not made; 3 s: made); one measured at 50 ms for 4 drafts at an
    eighth (20 s: 2.5 s, made; 31 s: 3.9 s against the 3.7 s its slower rounds save, not made). On a host of its
    own, always; and no draft tokens, never."""
    unmeasured = measured(0, model_s=None, draft_host_share=0.5)
    assert not unmeasured.prefill_could_pay(4, 96, 31.0)
    assert unmeasured.prefill_could_pay(4, 96, 3.0)
    assert unmeasured.prefill_could_pay(4, 960, 31.0)                  # a long answer repays a long prompt
    slow = measured(0, model_s=0.05, draft_host_share=0.5)
    assert slow.prefill_could_pay(4, 96, 20.0) and not slow.prefill_could_pay(4, 96, 31.0)
    assert measured(0, model_s=None).prefill_could_pay(4, 96, 31.0)   # a host of its own
    assert not unmeasured.prefill_could_pay(0, 96, 0.1)


async def test_alone_on_the_verifiers_cores_a_long_prompts_draft_prefill_is_not_made() -> None:
    """Through the generation: the verifier's prefill time prices the draft's (8 tokens to generate: at most 0.41 s
    saved by an unmeasured model; a prompt the verifier prefilled in 1.5 s would cost the draft's 0.5 s)."""
    idle = verifier_pb2.StartSessionResponse(first_token_id=7, token_cost=S, free_tokens=1, num_batch_tokens=3,
                                             num_sessions=1)
    assert (await prefills_made(0, idle, model_s=None, draft_host_share=0.5, verifier_prefill_s=1.5))[0] == 0
    assert (await prefills_made(0, idle, model_s=None, draft_host_share=0.5, verifier_prefill_s=0.1))[0] == 1
    assert (await prefills_made(0, idle, model_s=None, verifier_prefill_s=1.5))[0] == 1   # a host of its own


async def test_the_first_request_of_a_burst_is_not_alone_by_its_first_token() -> None:
    """Alone is judged when the draft prefill is decided, after the verifier's: the first of 4 streams starting
    together arrived alone, but by its first token 3 others ran beside it (it made a draft prefill and model trials
    every level of the concurrency bench, 0.2-1.6 s of the draft's CPU on the verifier's cores)."""
    busy = verifier_pb2.StartSessionResponse(first_token_id=7, token_cost=S, free_tokens=1, num_batch_tokens=17,
                                             num_other_rows=15, num_other_tokens=15, num_sessions=16)
    assert (await prefills_made(3, busy, arrived_alone=True))[0] == 0
    assert (await prefills_made(0, busy, arrived_alone=True))[0] == 1


async def test_the_first_round_does_not_wait_for_the_draft_prefill() -> None:
    """The draft prefill sent after the verifier's runs on while the rounds go (the suffix rule offers no model
    round until it is done): a long document's draft prefill never holds its stream's first rounds. Before, the
    first proposal awaited it: a ~4k-token prompt alone waited seconds in its first round for the draft's one
    thread. A prefill still running when the request ends is cancelled."""
    idle = verifier_pb2.StartSessionResponse(first_token_id=7, token_cost=S, free_tokens=1, num_batch_tokens=3,
                                             num_sessions=1)
    started = time.perf_counter()
    made, proposals = await prefills_made(0, idle, prefill_s=5.0)
    assert (made, proposals) == (1, [(1, 0)])               # proposed while the prefill ran
    assert time.perf_counter() - started < 2.0              # and close cancelled it
