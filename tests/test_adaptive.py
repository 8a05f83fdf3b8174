"""Adaptive draft length: k follows acceptance, costs and RTT, with hysteresis (load: test_load_aware_drafting.py)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from gateway.adaptive import AdaptiveParams, DraftLengthController, expected_tokens


def simulate(ctrl: DraftLengthController, rounds: int, acceptance: float, seed: int,
             draft_s: Callable[[int], float], verify_s: Callable[[int], float],
             forward_ran: Callable[[int], bool] = lambda k: True, rtt_s: float | None = None) -> list[int]:
    """Rounds of `ctrl`'s k, each draft accepted with prob `acceptance` until the first rejection; the round's draft
    wait, verify time and whether a forward ran are functions of k. Returns each round's k."""
    rng = random.Random(seed)
    ks = []
    for _ in range(rounds):
        k = ctrl.next_k()
        ks.append(k)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        ctrl.observe(k, accepted, draft_s=draft_s(k), verify_s=verify_s(k), rtt_s=rtt_s, forward_ran=forward_ran(k))
    return ks


def run_rounds(ctrl: DraftLengthController, rounds: int, acceptance: float, draft_per_token: float = 0.01,
               verify_base: float = 0.1, verify_per_token: float = 0.004, rtt: float | None = None,
               seed: int = 0) -> list[int]:
    """Simulate rounds: each drafted token is accepted with prob `acceptance` until the first rejection."""
    return simulate(ctrl, rounds, acceptance, seed, lambda k: k * draft_per_token,
                    lambda k: verify_base + verify_per_token * k, rtt_s=rtt)


def steady_k(acceptance: float, min_k: int = 0, **kwargs) -> int:
    ctrl = DraftLengthController(min_k=min_k, max_k=16, initial_k=4)
    run_rounds(ctrl, 200, acceptance, **kwargs)
    return ctrl.k


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 0.95])
@pytest.mark.parametrize("k", [0, 1, 4, 16])
def test_expected_tokens_matches_closed_form(a: float, k: int) -> None:
    assert expected_tokens([a] * 16, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))


def test_high_acceptance_grows_k_to_max() -> None:
    ctrl = DraftLengthController(min_k=0, max_k=16, initial_k=4)
    ks = run_rounds(ctrl, 40, acceptance=1.0)
    assert ks[0] == 4
    assert ctrl.k == 16 and ks[-1] == 16
    assert ctrl.acceptance() > 0.95


def test_low_acceptance_shrinks_k() -> None:
    ctrl = DraftLengthController(min_k=0, max_k=16, initial_k=8)
    run_rounds(ctrl, 40, acceptance=0.0)
    assert ctrl.k == 0
    ctrl1 = DraftLengthController(min_k=1, max_k=16, initial_k=8)
    run_rounds(ctrl1, 40, acceptance=0.0)
    assert ctrl1.k == 1 and ctrl1.next_k() == 1


def test_single_outlier_round_does_not_change_k() -> None:
    ctrl = DraftLengthController(min_k=0, max_k=16, initial_k=4)
    run_rounds(ctrl, 60, acceptance=0.8, seed=1)
    k = ctrl.k
    assert 2 <= k <= 16
    ctrl.observe(k, 0, draft_s=k * 0.01, verify_s=0.1 + 0.004 * k)   # everything rejected, once
    assert ctrl.k == k and ctrl.next_k() == k
    ctrl.observe(k, k, draft_s=k * 0.01, verify_s=5.0)                # one absurdly slow verify
    assert ctrl.k == k


def test_noisy_acceptance_does_not_flip_k_every_round() -> None:
    ctrl = DraftLengthController(min_k=0, max_k=16, initial_k=4)
    ks = run_rounds(ctrl, 300, acceptance=0.7, seed=2)
    changes = sum(1 for x, y in zip(ks[50:], ks[51:], strict=False) if x != y)
    assert changes <= 10, ks[50:]
    no_hysteresis = DraftLengthController(min_k=0, max_k=16, initial_k=4,
                                          params=AdaptiveParams(margin=0.0, patience=1, decay=0.5))
    ks_raw = run_rounds(no_hysteresis, 300, acceptance=0.7, seed=2)
    raw_changes = sum(1 for x, y in zip(ks_raw[50:], ks_raw[51:], strict=False) if x != y)
    assert raw_changes > changes   # the hysteresis is what keeps it stable


def test_expensive_drafts_give_smaller_k() -> None:
    cheap = steady_k(0.8, draft_per_token=0.002)
    pricey = steady_k(0.8, draft_per_token=0.05)
    assert pricey < cheap
    assert steady_k(0.8, draft_per_token=0.5) == 0   # a draft token costs more than a verify: don't draft


def test_link_rtt_favours_longer_blocks() -> None:
    assert steady_k(0.8, min_k=1, rtt=0.2) > steady_k(0.8, min_k=1, rtt=0.0)
    # a round trip dearer than what speculation saves: target-only (k = 0) wins when allowed
    assert steady_k(0.8, rtt=0.0) > 0 and steady_k(0.8, rtt=0.2) == 0


def test_verify_cost_slope_is_learned() -> None:
    ctrl = DraftLengthController(max_k=16)
    for k in (1, 4, 8, 1, 4, 8):
        ctrl.observe(k, k, draft_s=0.01 * k, verify_s=0.1 + 0.05 * k)
    assert ctrl.verify_cost(16) == pytest.approx(0.1 + 0.05 * 16, rel=1e-6)
    assert ctrl.draft_cost() == pytest.approx(0.01)


def test_probing_recovers_from_zero_when_draft_improves() -> None:
    ctrl = DraftLengthController(min_k=0, max_k=16, initial_k=4)
    run_rounds(ctrl, 40, acceptance=0.0)
    assert ctrl.k == 0
    ks = run_rounds(ctrl, 120, acceptance=1.0, seed=3)
    assert any(k > 0 for k in ks[:20])        # a probe round within probe_every rounds
    assert ctrl.k >= 8


def test_a_dear_probe_from_zero_waits_longer() -> None:
    """At k = 0 a probe of 2 drafts costs 0.2 s of drafting plus the dearer verify over a 0.1 s target-only round:
    it comes once in ~25 rounds (probes at most 10% of the time), not every 16."""
    ctrl = DraftLengthController(min_k=0, max_k=8, initial_k=4)
    run_rounds(ctrl, 40, acceptance=0.0, draft_per_token=0.1, verify_base=0.1, verify_per_token=0.02)
    assert ctrl.k == 0
    extra = ctrl.round_time(2) - ctrl.round_time(0)
    ks = run_rounds(ctrl, 200, acceptance=0.0, draft_per_token=0.1, verify_base=0.1, verify_per_token=0.02)
    probes = [i for i, k in enumerate(ks) if k > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert extra == pytest.approx(0.24, rel=0.1) and gaps and min(gaps) >= 22, gaps


def test_rejects_bad_counts() -> None:
    ctrl = DraftLengthController()
    with pytest.raises(ValueError):
        ctrl.observe(2, 3, 0.0, 0.1)
    with pytest.raises(ValueError):
        DraftLengthController(min_k=5, max_k=4)


def _measured(hit: bool) -> DraftLengthController:
    """Rounds of a chain of 4 plus 4 alternatives, 2 accepted, verify 0.3 s, draft 0.2 s; the accepted path takes
    an alternative every round (hit) or never."""
    c = DraftLengthController(max_k=4, initial_k=4)
    for _ in range(40):
        c.observe(8, 2, 0.2, 0.3)
        c.observe_tree(4, hit)
    return c


def test_tree_alternatives_are_priced_by_hits_per_node_against_the_round_rate() -> None:
    assert DraftLengthController(max_k=4).tree_width(3) == 3              # nothing measured: try trees
    hits = _measured(hit=True)                                            # 1 token per 4 nodes: beats the round
    assert hits.alternatives_pay() and hits.tree_width(3) == 3
    never = _measured(hit=False)
    assert not never.alternatives_pay()
    widths = [never.tree_width(3) for _ in range(32)]
    assert widths.count(3) == 2 and widths.count(0) == 30                 # off, but probed every 16 rounds
    assert never.tree_width(0) == 0




def _rounds_with_ahead(forward_ran_reported: bool) -> list[int]:
    """One stream whose verifier decodes ahead while idle: a k = 0 round is answered from tokens already decoded,
    in ~1 ms and with no forward; a drafted round runs a forward (0.1 s + 4 ms a token) and 80% of drafts hold.
    The stream starts at k = 0 (as after a run of rejections); only probes draft. Returns each round's k."""
    return simulate(DraftLengthController(min_k=0, max_k=4, initial_k=0), 300, 0.8, 1, lambda k: 0.005 * k,
                    lambda k: 0.1 + 0.004 * k if k > 0 else 0.001, lambda k: k > 0 or not forward_ran_reported)

def test_verdicts_without_a_forward_do_not_price_verify() -> None:
    """A verdict settled by tokens decoded ahead costs the round ~nothing but was paid for by earlier forwards: fed
    to the verify line it makes k = 0 look free, and the stream stays target-only at 80% acceptance."""
    biased = _rounds_with_ahead(forward_ran_reported=False)
    assert sum(k > 0 for k in biased) < 0.1 * len(biased)                # the bias this guards against
    ks = _rounds_with_ahead(forward_ran_reported=True)
    assert sum(k == 4 for k in ks[50:]) > 0.9 * len(ks[50:])


def test_draft_wait_splits_fixed_and_per_token_until_k_spreads_then_fits_the_line() -> None:
    ctrl = DraftLengthController(min_k=0, max_k=8, initial_k=1, params=AdaptiveParams(patience=10 ** 6))
    for _ in range(20):
        ctrl.observe(1, 1, draft_s=0.04, verify_s=0.1)
    assert ctrl.draft_time(4) == pytest.approx(0.04 * (0.5 + 0.5 * 4))    # one k seen: half fixed, half per token
    for k in (2, 4, 6) * 10:                                              # k spreads: 30 ms fixed + 5 ms a token
        ctrl.observe(k, k, draft_s=0.03 + 0.005 * k, verify_s=0.1)
    assert ctrl.draft_time(8) == pytest.approx(0.07, rel=0.02)
    for _ in range(40):                                                   # k settles: the slope is kept
        ctrl.observe(4, 4, draft_s=0.05, verify_s=0.1)
    assert ctrl.draft_time(8) == pytest.approx(0.07, rel=0.05)


def test_a_fixed_draft_wait_lets_one_stream_climb_from_k_1() -> None:
    """A draft service that drafts ahead makes a round wait ~40 ms for its draft whatever k: starting at k = 1 (as
    learned priors may start it), a stream whose drafts hold 80% of the time climbs to the longest block."""
    ks = simulate(DraftLengthController(min_k=0, max_k=4, initial_k=1), 200, 0.8, 3,
                  lambda k: 0.04 if k else 0.0, lambda k: 0.1 + 0.018 * k)
    assert sum(k == 4 for k in ks[100:]) > 80
