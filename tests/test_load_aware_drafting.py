"""Speculation that knows the load (issue 27): a session's drafts are priced by the verifier time they take from the
other sessions in the same forward (gateway/verify_cost.py, gateway/adaptive.py), so draft length and tree width
fall with load and low acceptance, and the verifier reports what that needs (VerifyResponse.num_other_rows /
.num_other_tokens, verifier_service/forward_share.py). Pure decisions first, then the verifier, then the stack."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.adaptive import AdaptiveParams, DraftLengthController
from gateway.suffix_choice import LOCAL, MODEL, NONE, ProposerChoice
from gateway.verify_cost import VerifyCost, forward_units, load_penalty, reported
from specmesh.spec.sampling import SamplingParams
from tests.stack import start_draft, start_gateway, start_verifier
from tests.test_e2e_greedy import PROMPTS, generate
from tests.test_forward_cost import verifier_with_forward_time
from tests.test_paged_verifier import handle_posted

S, ONE_ROW_S, DRAFT_S = 0.2, 0.1, 0.02     # compute-bound verifier: each row 0.2 of a one-row forward more
ACCEPTANCES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
LOADS = (0, 1, 2, 3, 4, 7, 15, 31)          # other sessions' rows in every forward (target-only: a token each)


def trained(acceptance: float, other_rows: int, free_tokens: int = 1, k: int = 8) -> DraftLengthController:
    """A controller after 400 rounds of k drafts (k held fixed, so every position's acceptance is measured) beside
    `other_rows` target-only rows, each forward costing ONE_ROW_S * t(rows): its best_k() is then a pure decision.
    Drafting costs DRAFT_S a token, and the controller is told so (draft_fixed_share 0): with k held fixed it could
    not tell a per-token wait from a fixed one."""
    rng = random.Random(0)
    params = AdaptiveParams(patience=10 ** 6, decay=0.99, draft_fixed_share=0.0)
    ctrl = DraftLengthController(max_k=k, initial_k=k, params=params)
    for _ in range(400):
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        rows = other_rows + k + 1
        ctrl.observe_verify_cost(VerifyCost(S, free_tokens, rows, other_rows, other_rows))
        ctrl.observe(k, accepted, draft_s=DRAFT_S * k, verify_s=ONE_ROW_S * forward_units(rows, S, free_tokens))
    return ctrl


def test_the_penalty_is_what_the_other_rows_would_have_yielded_in_that_time() -> None:
    assert load_penalty(4, 0, 0, S, 1) == 0.0                              # one stream: nobody to take from
    # 7 target-only rows, compute-bound: P(k) = 7 * 0.2 (k + 1) / (1 + 0.2 * 6)
    assert load_penalty(0, 7, 7, S, 1) == pytest.approx(7 * S / (1 + 6 * S))
    assert load_penalty(3, 7, 7, S, 1) == pytest.approx(4 * 7 * S / (1 + 6 * S))
    assert load_penalty(1, 2, 2, S, 4) == 0.0                              # 2 + 2 rows: within the 4 free ones
    assert load_penalty(2, 2, 2, S, 4) == pytest.approx(2 * S)             # the 5th row costs s, for 2 tokens
    # a row costs the others about a token as their rows grow (what a target-only row yields)
    assert load_penalty(0, 1000, 1000, S, 1) == pytest.approx(1.0, rel=0.01)


def test_queued_work_waited_for_the_forward_and_counts_as_other_rows() -> None:
    """Verifies that alternate between forwards share none, but the one queued behind this forward waited for it."""
    assert reported(0.2, 0, 4, 0, 0, 0) == VerifyCost(0.2, 1, 4, 0, 0)           # alone (free_tokens 0 reads 1)
    assert reported(0.2, 1, 4, 3, 5, 2) == VerifyCost(0.2, 1, 4, 5, 7)           # 2 queued: a row and a token each
    assert reported(0.2, 1, 0, 0, 0, 2) == VerifyCost(0.2, 1, 0, 0, 0)           # no forward ran: no load sample
    assert load_penalty(4, 1, 1, S, 1) - load_penalty(0, 1, 1, S, 1) == pytest.approx(4 * S)   # s a draft


def test_one_stream_drafts_as_before() -> None:
    """Reports of a forward with no other rows change nothing: the same k round after round as a controller that
    never hears of load, and k > 0 at good acceptance."""
    runs = []
    for report_load in (False, True):
        rng, ctrl, ks = random.Random(1), DraftLengthController(max_k=8, initial_k=4), []
        for _ in range(150):
            k = ctrl.next_k()
            ks.append(k)
            accepted = 0
            while accepted < k and rng.random() < 0.8:
                accepted += 1
            ctrl.observe_verify_cost(VerifyCost(S, 1, k + 1 if report_load else 0, 0, 0))
            ctrl.observe(k, accepted, draft_s=DRAFT_S * k, verify_s=ONE_ROW_S * forward_units(k + 1, S, 1))
        runs.append(ks)
    assert runs[0] == runs[1] and sum(runs[0][-50:]) / 50 >= 1.5


def test_many_rows_and_low_acceptance_choose_target_only_high_acceptance_still_drafts() -> None:
    assert trained(0.5, 0).best_k() >= 1 and trained(0.5, 15).best_k() == 0
    assert trained(0.95, 15).best_k() >= 3


def test_the_draft_length_falls_with_load_and_rises_with_acceptance() -> None:
    table = {(a, n): trained(a, n).best_k() for a in ACCEPTANCES for n in LOADS}
    for a in ACCEPTANCES:
        ks = [table[(a, n)] for n in LOADS]
        assert ks == sorted(ks, reverse=True), (a, ks)
    for n in LOADS:
        ks = [table[(a, n)] for a in ACCEPTANCES]
        assert ks == sorted(ks), (n, ks)
    assert table[(0.95, 0)] > table[(0.95, 31)] > 0 and table[(0.6, 0)] > table[(0.6, 7)] == 0


def test_drafts_within_the_free_rows_still_pay_beside_a_few_others() -> None:
    """F = 4 (memory-bound up to 4 rows): beside 1 other row, 2 drafts are free for everyone."""
    assert trained(0.5, 1, free_tokens=4).best_k() >= 2 and trained(0.5, 15, free_tokens=4).best_k() == 0


def test_the_controller_settles_at_target_only_under_load_and_returns_when_it_lifts() -> None:
    rng, ctrl = random.Random(1), DraftLengthController(max_k=8, initial_k=4)
    ks = []
    for i in range(240):
        other = 15 if 40 <= i < 160 else 0
        k = ctrl.next_k()
        ks.append(k)
        accepted = 0
        while accepted < k and rng.random() < 0.8:
            accepted += 1
        rows = other + k + 1
        ctrl.observe_verify_cost(VerifyCost(S, 1, rows, other, other))
        ctrl.observe(k, accepted, draft_s=DRAFT_S * k, verify_s=ONE_ROW_S * forward_units(rows, S, 1))
    assert min(ks[:40]) >= 1 and ctrl.load[0] < 1e-6           # (smoothed: the load faded)
    before, under, after = (sum(part) / len(part) for part in (ks[:40], ks[60:160], ks[-40:]))
    assert under <= 0.5 and ks[60:160].count(0) >= 50       # under load: mostly target-only, probes and luck aside
    assert before >= 2 and after >= 1.5                     # drafting alone, and again once the others are gone


def test_model_free_drafts_keep_their_length_alone_and_are_cut_beside_busy_rows() -> None:
    """Cache and n-gram drafts cost no draft compute, but their rows cost the other sessions like any."""
    assert trained(0.5, 0).local_draft_cap(12) == 12                    # alone: the tier's own length, as before
    assert trained(0.5, 15).local_draft_cap(12) == 0
    assert 0 < trained(0.95, 15).local_draft_cap(12) <= 8              # (at most the controller's max_k)


def test_tree_alternatives_go_when_a_node_costs_the_others_more_than_it_hits() -> None:
    quiet, busy = trained(0.6, 0, k=4), trained(0.6, 15, k=4)
    for ctrl in (quiet, busy):
        ctrl.observe_tree(4, True)                          # hit rate stays near the prior's 0.2
    assert quiet.tree_width(2) == 2
    assert busy.load_penalty_per_node() > quiet.alternative_hit_rate() and busy.tree_width(2) == 0


def test_the_proposer_choice_prices_the_same_load() -> None:
    """Half a token expected from 3 drafts within the free rows: taken alone, not beside 15 busy rows."""
    quiet, busy = ProposerChoice(), ProposerChoice()
    for choice, other in ((quiet, 0), (busy, 15)):
        for _ in range(30):
            choice.observe_verify(3, 0.1, VerifyCost(0.4, 4, other + 4, other, other))
            choice.observe_cost(LOCAL, 0.0001)
    assert quiet.choose({LOCAL: (0.5, 3)}) == LOCAL
    assert busy.choose({LOCAL: (0.5, 3)}) == NONE


def test_a_draft_model_on_the_verifiers_cores_is_priced_by_the_others_tokens_its_compute_costs() -> None:
    """A model round that pays beside one light stream on its own host does not where its 80 ms of compute take
    half the verifier's cores from that stream's forwards (draft_host_share 0.5); alone there is nobody to lose."""
    def trained(share: float, other: int) -> ProposerChoice:
        choice = ProposerChoice(draft_host_share=share)
        for _ in range(30):
            choice.observe_verify(0, 0.06, VerifyCost(0.1, 4, other + 1, other, other))
            choice.observe_model(4, 2, 0.08, 0.066)         # about 2 of 4 drafts accepted
            choice.observe_cost(MODEL, 0.08)
        return choice

    own_host, shared = trained(0.0, 1), trained(0.5, 1)
    assert own_host.contention(MODEL, 4) == 0 and shared.contention(LOCAL, 4) == 0
    assert shared.contention(MODEL, 4) == pytest.approx(0.5 * 1 / 0.06 * 0.08, rel=0.01)   # 0.67 tokens a round
    options = {MODEL: (own_host.expected_model(4), 4)}
    assert own_host.choose(options) == MODEL
    assert shared.choose(options) == NONE
    assert shared.rate(MODEL, *options[MODEL]) < shared.rate(NONE, 0.0, 0) < own_host.rate(MODEL, *options[MODEL])
    alone = trained(0.5, 0)
    assert alone.contention(MODEL, 4) == 0 and alone.choose(options) == MODEL


# ------------------------------------------------------------------------------------------------- the verifier
async def test_each_verdict_says_what_the_other_sessions_had_of_its_forward() -> None:
    verifier = await start_verifier()
    engine = verifier.engine
    try:
        engine.stop()                               # freeze the engine thread: run its steps by hand
        starts = [engine.start_session(f"share{i}", [1, 2, 3, 4 + i], SamplingParams()) for i in range(3)]
        handle_posted(engine, 3)
        engine.step()
        first = [await s.future for s in starts]
        assert [(r.num_other_rows, r.num_other_tokens) for r in first] == [(8, 2)] * 3   # 4-token prompts
        verifies = [engine.verify(f"share{i}", [7] * (i + 1), None) for i in range(3)]
        handle_posted(engine, 3)
        engine.step()
        results = [await v.future for v in verifies]
        rows = [2, 3, 4]                            # pending token + drafts
        emitted = [len(r.token_ids) for r in results]
        assert [r.num_batch_tokens for r in results] == [sum(rows)] * 3
        assert [r.num_other_rows for r in results] == [sum(rows) - n for n in rows]
        assert [r.num_other_tokens for r in results] == [sum(emitted) - e for e in emitted]
    finally:
        await verifier.server.stop(0)


# ------------------------------------------------------------------------------------------------- the stack
async def test_concurrent_streams_make_the_verifier_report_rows_and_the_draft_length_drops(monkeypatch) -> None:
    """The draft model is the target itself (unquantized beside the int8 verifier: nearly every draft accepted,
    so acceptance is not what changes). Each forward costs 20 ms for up to 4 rows and 40 ms per row beyond: one stream
    drafts 3 (4 rows, free); six streams bring each other's rows, which the verifier reports, and the controllers
    price drafts at what they take from the others. Outputs equal this verifier's target-only greedy throughout."""
    seen: list[VerifyCost] = []
    observe = DraftLengthController.observe_verify_cost
    monkeypatch.setattr(DraftLengthController, "observe_verify_cost",
                        lambda self, cost: (seen.append(cost), observe(self, cost))[1])
    prompts = PROMPTS[:6]
    async with verifier_with_forward_time(lambda n: 0.02 + 0.04 * max(0, n - 4)) as (verifier, _):
        draft = await start_draft(model="tiny-target")
        gateway = await start_gateway(verifier.addr, draft.addr, adaptive_draft_length=True, learned_priors=False)
        try:
            expected = [ids for ids, _, _ in await asyncio.gather(*[generate(
                gateway.addr, p, max_new_tokens=16, ignore_eos=True, num_draft_tokens=0) for p in prompts])]
            seen.clear()
            alone = await generate(gateway.addr, prompts[0], max_new_tokens=16, ignore_eos=True, num_draft_tokens=3)
            alone_reports, alone_drafted = list(seen), _drafted_per_round(alone[2])
            seen.clear()
            together = await asyncio.gather(*[generate(gateway.addr, p, max_new_tokens=16, ignore_eos=True,
                                                       num_draft_tokens=3) for p in prompts])
        finally:
            await gateway.stop()
            await draft.stop()
    assert alone[0] == expected[0] and [ids for ids, _, _ in together] == expected
    assert alone_reports and all(c.other_rows == 0 for c in alone_reports) and alone_drafted > 2.5
    assert max(c.other_rows for c in seen) >= 4                      # the load reached the controllers
    drafted = sum(_drafted_per_round(r) for _, _, r in together) / len(together)
    assert drafted < alone_drafted, (drafted, alone_drafted)


def _drafted_per_round(responses: list) -> float:
    rounds = [r.round for r in responses if r.HasField("round") and r.round.round > 0]
    return sum(r.num_drafted for r in rounds) / max(1, len(rounds))
