"""The composed drafting policy without gRPC: the tiers' order and fall-through, suffix drafting's rule, and the one
round cost model, fed once per round by the round loop (gateway/proposers/)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gateway.adaptive import DraftLengthController
from gateway.draft_link import DraftLink
from gateway.proposers.base import NO_DRAFT, Draft, Verified, VerifiedTokens
from gateway.proposers.compose import build_policy
from gateway.proposers.cost_model import LocalCaps, RoundCostModel, RoundObservation
from gateway.proposers.policy import ProposerPolicy
from gateway.proposers.suffix_rule import CATCH_UP_IN_ROUND, SuffixRule
from gateway.proposers.tier_order import TierOrder
from gateway.replicas import VerifierPool
from gateway.request_state import RoundEvent
from gateway.round_loop import Generation
from gateway.tiers import DraftTiers, TierSettings
from gateway.validation import GenerationParams
from gateway.verify_cost import UNKNOWN_COST, VerifyCost
from kvstore.keys import KeyDeriver
from kvstore.memory import MemoryDraftCache
from protos.specmesh.v1 import common_pb2
from specmesh.spec.sampling import SamplingParams

CACHE, NGRAM, MODEL = (common_pb2.DRAFT_SOURCE_CACHE, common_pb2.DRAFT_SOURCE_NGRAM,
                       common_pb2.DRAFT_SOURCE_MODEL)


class FakeModel:
    """A draft model (the ModelProposer protocol) that drafts 7s and counts its calls."""

    def __init__(self) -> None:
        self.link = DraftLink(bound=True)           # prefilled beside the verifier, as a request alone is
        self.tree_width, self.tree_pricing = 0, None
        self.resend_in_round_max: int | None = None
        self.num_prefetch_hits = self.bytes_sent = self.bytes_received = 0
        self.calls: list[int] = []
        self.prefills: list[list[int]] = []
        self.resends: list[list[int]] = []

    @property
    def prefetching(self) -> bool:
        return False

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        self.calls.append(num_tokens)
        self.link.send(context_ids)                 # the service holds the context now (ModelDrafter.propose)
        return Draft([7] * num_tokens, None, MODEL)

    def observe(self, draft: Draft, num_accepted: int, verified: Verified, cost: VerifyCost = UNKNOWN_COST) -> None:
        pass

    async def prefill(self, prompt_ids: list[int], num_tokens: int) -> None:
        self.prefills.append(prompt_ids)
        await asyncio.sleep(0.01)
        self.link.send(prompt_ids)

    async def sync(self, context_ids: list[int], num_tokens: int, backs_off: bool = False) -> None:
        (self.resends if backs_off else self.prefills).append(context_ids)
        await asyncio.sleep(0.01)
        self.link.send(context_ids)

    def prefetch(self, context_ids: list[int], draft: Draft, num_tokens: int) -> None:
        pass

    async def close(self) -> None:
        pass


def tiers(enable_ngram: bool = True, cache: bool = True, **settings: object) -> DraftTiers:
    store = MemoryDraftCache(KeyDeriver(b"k", "m", "t", (8, 4, 2)), ttl_s=60) if cache else None
    return DraftTiers(TierSettings(vocab_size=1000, enable_ngram=enable_ngram, **settings), store)  # type: ignore[arg-type]


async def cached(t: DraftTiers, prompt: Sequence[int], output: list[int]) -> None:
    """A finished request that wrote its verified output to the cache."""
    writer = build_policy(t, None, "a")
    writer.observe(NO_DRAFT, 0, VerifiedTokens(prompt, output))
    await writer.close()


def observation(draft: Draft, num_accepted: int) -> RoundObservation:
    return RoundObservation(draft.source, len(draft.token_ids), num_accepted, 0.01, 0.1, draft=draft)


async def test_the_cache_drafts_first_then_ngram_then_the_model() -> None:
    t, model = tiers(), FakeModel()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    await cached(t, prompt, [11, 12, 13, 14, 15, 16])
    policy = build_policy(t, model, "a")
    assert isinstance(policy.rule, TierOrder)
    assert (await policy.propose(prompt + [11, 12], 4, 10)).source == CACHE           # the cache has it
    repeat = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    draft = await policy.propose(repeat, 4, 10)                                      # a cache miss: the n-gram
    assert draft.source == NGRAM and draft.token_ids == [4, 5, 6, 1, 2, 3]
    assert model.calls == []
    draft = await policy.propose([40, 41, 42], 4, 10)                                # both miss: the model
    assert draft.source == MODEL and model.calls == [4]
    snapshot = t.snapshot()
    assert (snapshot["cache_hits"], snapshot["cache_misses"]) == (1, 2)
    assert (snapshot["ngram_hits"], snapshot["ngram_misses"]) == (1, 1)
    assert snapshot["model_hits"] == 1


async def test_a_missing_tier_is_skipped_and_no_room_drafts_nothing() -> None:
    model = FakeModel()
    policy = build_policy(tiers(enable_ngram=False, cache=False), model, "a")
    assert (await policy.propose([1, 2, 3, 1, 2], 3, 10)).source == MODEL              # no n-gram tier asked
    assert (await policy.propose([1, 2, 3], 3, 0)) is NO_DRAFT and model.calls == [3]
    assert build_policy(tiers(), None, "a").proposers.model is None


async def test_local_drafts_fill_the_room_up_to_the_cap_the_cost_model_learned() -> None:
    policy = build_policy(tiers(cache=False, local_max_tokens=8), None, "a")
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3]
    draft = await policy.propose(context, 2, 20)
    assert draft.token_ids == [4, 5, 6, 7, 8, 9, 10, 11]                              # the cap, not num_tokens
    policy.cost_model.observe(observation(draft, 1))                                 # cut to accepted + 1
    assert len((await policy.propose(context, 2, 20)).token_ids) == 2
    policy.observe(draft, 1, VerifiedTokens(context, []))                            # counters only: no learning
    assert policy.cost_model.local_room(NGRAM, 20) == 2
    policy.cost_model.observe(observation(Draft([4, 5], None, NGRAM), 2))             # all accepted: doubled
    assert policy.cost_model.local_room(NGRAM, 20) == 4


def test_the_suffix_mode_is_one_policy_whose_choice_prices_load_with_the_controller() -> None:
    length = DraftLengthController(max_k=8, initial_k=8)
    policy = build_policy(tiers(cache=False, suffix_drafting=True), FakeModel(), "a", length)
    assert isinstance(policy.rule, SuffixRule)
    choice = policy.cost_model.choice
    assert choice is not None and choice.load is length and policy.cost_model.length is length
    assert policy.proposers.local_suffix is not None and policy.proposers.cache is None


def test_the_cost_model_learns_as_the_draft_length_controller_did() -> None:
    """The default mode: the one observe does what the round loop's draft-length listener did, in that order."""
    model, reference = RoundCostModel(DraftLengthController(max_k=8, initial_k=4)), \
        DraftLengthController(max_k=8, initial_k=4)
    cost = VerifyCost(0.2, 2, 3, 2, 2)
    for i in range(30):
        accepted = i % 5
        draft = Draft([1] * 6 + [9], None, MODEL, [-1, 0, 1, 2, 3, 4, 0])
        model.observe(RoundObservation(MODEL, 7, accepted, 0.01 * i, 0.1, cost, None, 1, False, draft=draft))
        reference.observe_verify_cost(cost)
        reference.observe(7, accepted, 0.01 * i, 0.1)
        reference.observe_tree(1, False)
        assert model.draft_length(4) == reference.next_k()
        assert model.tree_width(2) == reference.tree_width(2)
    assert model.memory().length == reference.memory()


def test_a_local_tier_round_prices_verify_but_not_the_models_acceptance() -> None:
    """Acceptance is per proposer: n-gram drafts rejected at once leave the draft model's acceptance (and so its k)
    as the model's own rounds made it, while their verify times still price verify(k)."""
    model, only_model = (RoundCostModel(DraftLengthController(max_k=4, initial_k=4)) for _ in range(2))
    cost = VerifyCost(0.2, 1, 5, 0, 0)
    for i in range(40):
        rounds = [RoundObservation(MODEL, 4, 4, 0.01, 0.1, cost)]
        if i % 2:
            rounds.append(RoundObservation(common_pb2.DRAFT_SOURCE_NGRAM, 4, 0, 0.0, 0.5, cost))
        for r in rounds:
            model.observe(r)
        only_model.observe(rounds[0])
    assert model.length is not None and only_model.length is not None
    assert model.length.acceptance() == only_model.length.acceptance()
    assert model.length.verify_cost(4) > only_model.length.verify_cost(4)    # the n-gram rounds' slower verifies


def test_a_generation_feeds_its_cost_model_once_per_round() -> None:
    class Spy(RoundCostModel):
        def __init__(self) -> None:
            super().__init__(local_caps=LocalCaps(16))
            self.seen: list[RoundObservation] = []

        def observe(self, round: RoundObservation) -> None:
            self.seen.append(round)

    spy = Spy()
    proposers = build_policy(tiers(), None, "a").proposers
    policy = ProposerPolicy(proposers, TierOrder(proposers, spy), spy)
    params = GenerationParams("r", [1, 2], SamplingParams(), 16, (), 4, True)
    generation = Generation(params, "r-1", VerifierPool.of_stubs([]), policy, 10.0, cost_model=spy)
    generation.state.on_first_token(5)
    draft = Draft([6, 7, 8], None, NGRAM, [-1, 0, 0])
    generation.state.on_round(RoundEvent(1, draft, 1, [6, 9], 0.01, 0.2, 0, 4, [0, 2], VerifyCost(0.1)))
    assert len(spy.seen) == 1
    seen = spy.seen[0]
    assert (seen.source, seen.num_drafted, seen.num_accepted, seen.draft_s, seen.verify_s) == (NGRAM, 3, 1, 0.01, 0.2)
    assert (seen.num_alternatives, seen.alternative_hit, seen.accepted_ids) == (1, True, (6,))
    assert seen.draft is draft and seen.cost == VerifyCost(0.1)


async def test_a_model_round_never_waits_for_the_draft_service_to_prefill_the_context() -> None:
    """Where the draft service was never sent the request's context (its prefill was skipped under load), the model
    is no option: its first Propose would prefill the whole context while the stream waits."""
    model = FakeModel()
    model.link = DraftLink()                             # never prefilled
    policy = build_policy(tiers(suffix_drafting=True, cache=False), model, "a")
    for _ in range(3):
        assert (await policy.propose([40, 41, 42, 43], 4, 10)).source != MODEL
    assert model.calls == [] and model.prefills == []


async def test_after_a_failed_call_the_context_is_resent_in_the_background_not_in_a_round() -> None:
    """A failed call unbinds the draft link: the draft service (the replica it reroutes to) needs the whole context
    again. That resend is a prefill of its own, like the prompt's: the rounds meanwhile draft without the model (a
    ~4k-token document resent inside a Propose held its stream for the whole draft prefill); once it is done the
    model is offered again. A resend still running when the request ends is cancelled."""
    model = FakeModel()
    model.link = DraftLink(num_failures=1)               # unbound by a failed call
    policy = build_policy(tiers(suffix_drafting=True, cache=False), model, "a")
    assert (await policy.propose([40, 41, 42, 43], 4, 10)).source != MODEL
    assert (await policy.propose([40, 41, 42, 43, 44], 4, 10)).source != MODEL    # one resend, still running
    await asyncio.sleep(0)
    assert model.calls == [] and model.resends == [[40, 41, 42, 43]]
    await asyncio.sleep(0.03)
    assert not policy.proposers.model_prefilling
    assert (await policy.propose([40, 41, 42, 43, 44], 4, 10)).source == MODEL and model.calls == [4]
    model.link = DraftLink(num_failures=2)               # failed again: a resend the request's end cancels
    assert (await policy.propose([40, 41, 42, 43, 44, 45], 4, 10)).source != MODEL
    await asyncio.sleep(0)
    await policy.close()
    assert not policy.proposers.model_prefilling and len(model.resends) == 2


async def test_a_session_the_service_lost_is_resent_in_the_background() -> None:
    """Suffix drafting's rounds resend a lost draft session (NOT_FOUND: a restart, an expired lease) outside the
    round, as after a failure: the composer caps what a round's Propose resends whole, and a link left unbound by
    such a resend (no failure) is synced in the background, the model offered again once it is done."""
    model = FakeModel()
    policy = build_policy(tiers(suffix_drafting=True, cache=False), model, "a")
    assert model.resend_in_round_max == CATCH_UP_IN_ROUND
    model.link = DraftLink(num_resends=1)                # the round's Propose found the session gone
    assert (await policy.propose([40, 41, 42, 43], 4, 10)).source != MODEL and policy.proposers.model_prefilling
    await asyncio.sleep(0)
    assert model.calls == [] and model.resends == [[40, 41, 42, 43]]
    await asyncio.sleep(0.03)
    assert (await policy.propose([40, 41, 42, 43, 44], 4, 10)).source == MODEL and model.calls == [4]


async def test_a_long_catch_up_goes_in_the_background_and_a_short_one_in_the_round() -> None:
    """A model round after many suffix or undrafted rounds would wait while the draft service computes every token
    verified since its last call (beside a long prompt's prefill: 3.3 s for ~1,000). Past CATCH_UP_IN_ROUND tokens
    the catch-up is sent in the background and the round drafts without the model; once it is computed the model
    drafts with a short delta, in the round."""
    model = FakeModel()
    model.link = DraftLink()
    model.link.send(list(range(40, 44)))                # the draft service holds the prompt
    policy = build_policy(tiers(suffix_drafting=True, cache=False), model, "a")
    assert (await policy.propose(list(range(40, 44 + CATCH_UP_IN_ROUND)), 4, 10)).source == MODEL
    assert model.calls == [4] and model.resends == []                # a short one: in the round
    context = list(range(40, 45 + 3 * CATCH_UP_IN_ROUND))
    model.link.num_synced = 4                                        # the rounds since drafted without the model
    assert (await policy.propose(context, 4, 10)).source != MODEL and policy.proposers.model_prefilling
    await asyncio.sleep(0)
    assert model.calls == [4] and model.resends == [context]
    await asyncio.sleep(0.03)
    assert (await policy.propose(context + [7], 4, 10)).source == MODEL and model.calls == [4, 4]


async def test_no_model_round_while_the_draft_service_prefills_the_prompt() -> None:
    """The round loop sends the draft prefill after the verifier's, in the background (its first token does not wait
    for it): until it is done the suffix rule drafts without the model rather than wait for it."""
    model = FakeModel()
    policy = build_policy(tiers(suffix_drafting=True, cache=False), model, "a")
    prefill = asyncio.ensure_future(policy.prefill([40, 41, 42, 43], 4))
    await asyncio.sleep(0)
    assert policy.proposers.model_prefilling
    assert (await policy.propose([40, 41, 42, 43], 4, 10)).source != MODEL and model.calls == []
    await prefill
    assert not policy.proposers.model_prefilling
    assert (await policy.propose([40, 41, 42, 43], 4, 10)).source == MODEL and model.calls == [4]
