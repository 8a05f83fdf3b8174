"""Learned priors: a new request starts from what the gateway's ended requests measured (costs, acceptance), per
tenant and greedy/sampled, worth only a few rounds, so its own rounds take over; through the stack the output stays
exact and the first round already uses the learned draft length."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from gateway.adaptive import DraftLengthController
from gateway.learned_priors import EXPLORE_EVERY, LearnedPriors, PriorKey
from gateway.proposers.cost_model import RoundCostModel
from gateway.suffix_choice import LOCAL, MODEL, ProposerChoice
from gateway.suffix_tree import Proposal
from gateway.verify_cost import VerifyCost
from protos.specmesh.v1 import generate_pb2_grpc
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from tests.stack import reference_greedy, start_draft, start_gateway, start_verifier
from tests.test_adaptive import run_rounds

GREEDY = PriorKey("", sampled=False)


CPU_COSTS = {"draft_per_token": 0.08, "verify_base": 0.12, "verify_per_token": 0.05}   # drafting barely pays
CHEAP_DRAFTS = {"draft_per_token": 0.01, "verify_base": 0.1, "verify_per_token": 0.004}


def finished_request(priors: LearnedPriors, acceptance: float, key: PriorKey = GREEDY, rounds: int = 30,
                     costs: dict[str, float] = CPU_COSTS) -> None:
    ctrl = DraftLengthController(max_k=8, initial_k=8)
    priors.start(key, RoundCostModel(ctrl))
    run_rounds(ctrl, rounds, acceptance, **costs)
    priors.finish(key, RoundCostModel(ctrl))


def test_a_new_request_starts_at_the_draft_length_ended_requests_learned() -> None:
    priors = LearnedPriors()
    finished_request(priors, acceptance=0.0)
    low = DraftLengthController(max_k=8, initial_k=8)
    priors.start(GREEDY, RoundCostModel(low))
    assert low.k == 1                                  # best is 0 (drafts never pay); speculation still probes
    assert low.draft_cost() == pytest.approx(0.08) and low.verify_cost(0) is not None

    priors = LearnedPriors()
    finished_request(priors, acceptance=1.0, costs=CHEAP_DRAFTS)
    high = DraftLengthController(max_k=8, initial_k=2)
    priors.start(GREEDY, RoundCostModel(high))
    assert high.k == 8


def test_a_short_request_spends_fewer_rounds_at_a_bad_draft_length() -> None:
    priors = LearnedPriors()
    finished_request(priors, acceptance=0.0)
    cold, warm = DraftLengthController(max_k=8, initial_k=8), DraftLengthController(max_k=8, initial_k=8)
    priors.start(GREEDY, RoundCostModel(warm))
    cold_ks = run_rounds(cold, 8, 0.0, **CPU_COSTS)
    warm_ks = run_rounds(warm, 8, 0.0, **CPU_COSTS)
    assert sum(warm_ks) < sum(cold_ks) / 2             # every drafted token was wasted time here
    assert warm_ks[0] <= 1 and cold_ks[0] == 8


def test_the_request_s_own_rounds_outweigh_the_prior() -> None:
    priors = LearnedPriors()
    for _ in range(5):
        finished_request(priors, acceptance=0.0, costs=CHEAP_DRAFTS)
    ctrl = DraftLengthController(max_k=8, initial_k=8)
    priors.start(GREEDY, RoundCostModel(ctrl))
    assert ctrl.k == 1
    run_rounds(ctrl, 12, 1.0, **CHEAP_DRAFTS)
    assert ctrl.k >= 4 and ctrl.acceptance() > 0.8    # a prior of at most 3 rounds cannot hold it back


def test_a_tenant_starts_from_its_own_book_else_the_gateway_s() -> None:
    priors = LearnedPriors()
    finished_request(priors, acceptance=0.0, key=PriorKey("a", False), costs=CHEAP_DRAFTS)
    assert priors.rounds(PriorKey("a", False))[0] > 0 and priors.rounds(PriorKey("a", True)) == (0.0, 0.0)
    assert priors.rounds(PriorKey("b", False)) == (0.0, 0.0)
    newcomer = DraftLengthController(max_k=8, initial_k=8)
    priors.start(PriorKey("b", False), RoundCostModel(newcomer))   # no book of its own: the gateway's (tenant a's)
    assert newcomer.k == 1 and newcomer.draft_cost() == pytest.approx(0.01)
    sampled = DraftLengthController(max_k=8, initial_k=8)
    priors.start(PriorKey("b", True), RoundCostModel(sampled))            # nothing sampled has ended yet
    assert sampled.k == 8 and sampled.draft_cost() is None
    finished_request(priors, acceptance=1.0, key=PriorKey("b", False), costs=CHEAP_DRAFTS)
    own, other = DraftLengthController(max_k=8, initial_k=2), DraftLengthController(max_k=8, initial_k=2)
    priors.start(PriorKey("b", False), RoundCostModel(own))
    priors.start(PriorKey("a", False), RoundCostModel(other))
    assert own.acceptance() > other.acceptance() + 0.3          # each tenant's own book first


def test_a_request_without_rounds_adds_nothing() -> None:
    priors = LearnedPriors()
    priors.finish(GREEDY, RoundCostModel(DraftLengthController(max_k=4), ProposerChoice()))
    assert priors.rounds(GREEDY) == (0.0, 0.0)


def test_memory_round_trip_keeps_the_estimates() -> None:
    ctrl = DraftLengthController(max_k=8, initial_k=4)
    run_rounds(ctrl, 20, 0.7, rtt=0.01, seed=3)
    ctrl.observe_verify_cost(VerifyCost(0.4))
    copy = DraftLengthController(max_k=8, initial_k=4)
    copy.remember(ctrl.memory(), max_rounds=1e9)
    assert copy.acceptance() == pytest.approx(ctrl.acceptance())
    assert copy.position_acceptance() == pytest.approx(ctrl.position_acceptance())
    assert copy.draft_cost() == pytest.approx(ctrl.draft_cost())
    for k in (0, 3, 8):
        assert copy.round_time(k) == pytest.approx(ctrl.round_time(k))
    assert copy.k == max(ctrl.best_k(), 1)


def test_book_blends_requests_halving_the_older_evidence() -> None:
    priors = LearnedPriors(keep=0.5)
    finished_request(priors, acceptance=1.0)
    one = priors.rounds(GREEDY)[0]
    finished_request(priors, acceptance=1.0)
    assert priors.rounds(GREEDY)[0] == pytest.approx(0.5 * one + one, rel=0.05)


def test_a_choice_starts_knowing_costs_and_how_far_suffix_counts_can_be_trusted() -> None:
    choice = ProposerChoice()
    proposal = Proposal([5, 6, 7, 8], [-1, 0, 1, 2], [0.9, 0.8, 0.7, 0.6], 3)
    for _ in range(20):
        choice.observe_cost(MODEL, 0.3)
        choice.observe_cost(LOCAL, 0.001)
        choice.observe_verify(4, 0.3, VerifyCost(0.4))
        choice.observe_suffix(LOCAL, proposal, [])            # the suffix drafts were never accepted
    priors = LearnedPriors()
    priors.finish(GREEDY, RoundCostModel(choice=choice))
    fresh, warm = ProposerChoice(), ProposerChoice()
    priors.start(GREEDY, RoundCostModel(choice=warm))
    assert fresh.cost_s(MODEL, 4) == 0.0 and warm.cost_s(MODEL, 4) == pytest.approx(0.3)
    assert warm.verify_slope == 0.4 and warm.verify_s(0) == pytest.approx(choice.verify_s(0))
    assert warm.expected_suffix(LOCAL, proposal) < 0.5 * fresh.expected_suffix(LOCAL, proposal)


# ---------------------------------------------------------------------------------------------- through the stack
PROMPT = "the quick brown fox jumps over"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack():
    verifier = await start_verifier()
    draft = await start_draft("tiny-draft-unrelated")            # model drafts mostly rejected
    learned = await start_gateway(verifier.addr, draft.addr, adaptive_draft_length=True)
    cold = await start_gateway(verifier.addr, draft.addr, adaptive_draft_length=True, learned_priors=False)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    yield {"learned": learned, "cold": cold, "tokenizer": tokenizer}
    for running in (learned, cold, draft, verifier):
        await running.stop()


async def first_round_drafts(addr: str) -> tuple[int, list[int]]:
    async with grpc.aio.insecure_channel(addr) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(
            client.make_request(PROMPT, max_new_tokens=24, ignore_eos=True, num_draft_tokens=8), timeout=120)
        responses = [r async for r in call]
    drafted = [r.round.num_drafted for r in responses if r.round.round == 1]
    return drafted[0], [t for r in responses for t in r.token_ids]


async def test_the_second_request_starts_from_the_first_one_s_draft_length(stack) -> None:
    expected = reference_greedy(stack["tokenizer"](PROMPT)["input_ids"], 24)
    first_k, first_ids = await first_round_drafts(stack["learned"].addr)
    second_k, second_ids = await first_round_drafts(stack["learned"].addr)
    cold_k, cold_ids = await first_round_drafts(stack["cold"].addr)
    assert first_ids == second_ids == cold_ids == expected
    assert first_k == 8 and cold_k == 8                 # nothing learned yet / learning off: the request's k
    assert second_k <= 2                                 # the unrelated draft's rejections were remembered


def test_a_choice_started_from_a_poor_model_book_still_tries_the_model_on_its_own_text() -> None:
    """Chat requests taught the book that model rounds do not pay; a code request must still measure the model."""
    chat = ProposerChoice()
    for _ in range(20):
        chat.observe_cost(MODEL, 0.3)
        chat.observe_verify(3, 0.1, VerifyCost(0.4, 4))
        chat.observe_model(3, 0, 0.3, 0.1)
    priors = LearnedPriors()
    priors.finish(GREEDY, RoundCostModel(choice=chat))
    code = ProposerChoice()
    priors.start(GREEDY, RoundCostModel(choice=code))
    option = {MODEL: (code.expected_model(3), 3)}
    assert code.rate(MODEL, *option[MODEL]) < code.rate("none", 0.0, 0)     # the estimates say target-only
    picks = []
    for _ in range(4):
        picks.append(code.choose(dict(option)))
        if picks[-1] == MODEL:
            code.observe_model(3, 0, 0.3, 0.1)                               # ... and the trials agree
    assert picks == [MODEL, MODEL, "none", "none"]


def test_every_sixteenth_request_starts_without_the_model_cost_so_a_locked_out_model_is_measured_again() -> None:
    """With the draft on the verifier's cores, a model whose booked cost says it could not pay gets no trial and no
    draft prefill, so its cost would never be measured again (one slow measure, on a busy moment, kept for good).
    Every EXPLORE_EVERY-th request starts with it unmeasured: that one tries the model; the book keeps the cost."""
    booked = ProposerChoice(draft_host_share=0.5)
    for _ in range(20):
        booked.observe_cost(MODEL, 0.3)
        booked.observe_verify(0, 0.1, VerifyCost(0.25))
    priors = LearnedPriors()
    priors.finish(GREEDY, RoundCostModel(choice=booked))
    tried = []
    for _ in range(2 * EXPLORE_EVERY):
        choice = ProposerChoice(draft_host_share=0.5)
        priors.start(GREEDY, RoundCostModel(choice=choice))
        tried.append(choice.could_pay(MODEL, 4))
    assert [i for i, t in enumerate(tried, start=1) if t] == [EXPLORE_EVERY, 2 * EXPLORE_EVERY]
    assert priors._choices[GREEDY].costs == booked.memory().costs      # the book itself keeps the cost
    # Beside other requests none explores (its trials would take the others' compute), nor do they count.
    beside = []
    for _ in range(2 * EXPLORE_EVERY):
        choice = ProposerChoice(draft_host_share=0.5)
        priors.start(GREEDY, RoundCostModel(choice=choice), alone=False)
        beside.append(choice.could_pay(MODEL, 4))
    assert not any(beside)
    alone_again = []
    for _ in range(EXPLORE_EVERY):
        choice = ProposerChoice(draft_host_share=0.5)
        priors.start(GREEDY, RoundCostModel(choice=choice))
        alone_again.append(choice.could_pay(MODEL, 4))
    assert [i for i, t in enumerate(alone_again, start=1) if t] == [EXPLORE_EVERY]


def test_a_sampled_request_after_greedy_ones_starts_from_their_costs_but_not_their_acceptance() -> None:
    """Costs are the deployment's: a gateway warmed up greedy knows a draft model round cannot pay on the verifier's
    cores, and its first sampled request must not make the draft prefill and trials to learn it again; how often
    drafts are accepted differs between greedy and sampled requests, so that stays the sampled request's own."""
    greedy = ProposerChoice(draft_host_share=0.5)
    proposal = Proposal([5, 6, 7, 8], [-1, 0, 1, 2], [0.9, 0.8, 0.7, 0.6], 3)
    for _ in range(20):
        greedy.observe_cost(MODEL, 0.3)
        greedy.observe_verify(0, 0.1, VerifyCost(0.25))
        greedy.observe_suffix(LOCAL, proposal, [0, 1, 2, 3])            # greedy: every suffix draft accepted
    priors = LearnedPriors()
    priors.finish(GREEDY, RoundCostModel(choice=greedy))
    sampled_key = PriorKey("", sampled=True)
    fresh, sampled = ProposerChoice(draft_host_share=0.5), ProposerChoice(draft_host_share=0.5)
    priors.start(sampled_key, RoundCostModel(choice=sampled))
    assert fresh.could_pay(MODEL, 4) and fresh.prefill_could_pay(4, 64, 1.3)      # unmeasured: free
    assert sampled.cost_s(MODEL, 4) == pytest.approx(0.3)
    assert sampled.verify_s(0) == pytest.approx(greedy.verify_s(0))
    assert not sampled.could_pay(MODEL, 4) and not sampled.prefill_could_pay(4, 64, 1.3)
    assert sampled.expected_suffix(LOCAL, proposal) == pytest.approx(fresh.expected_suffix(LOCAL, proposal))
    # A sampled request's own book, once there, is the one a sampled request starts from.
    for _ in range(20):
        sampled.observe_cost(MODEL, 0.01)
        sampled.observe_verify(0, 0.1, VerifyCost(0.25))
    priors.finish(sampled_key, RoundCostModel(choice=sampled))
    later = ProposerChoice(draft_host_share=0.5)
    priors.start(sampled_key, RoundCostModel(choice=later))
    assert later.cost_s(MODEL, 4) < 0.3
