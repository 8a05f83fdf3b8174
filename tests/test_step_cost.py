"""The measured cost of an engine step (specmesh/engine/step_cost.py), on plain floats: sizes interpolated and kept
monotone by a weighted isotonic fit, recent steps followed, stale or cold buckets giving way, attention pairs priced
only when steps of one size differ in them."""

from __future__ import annotations

import pytest

from specmesh.engine.step_cost import StepCost, attention_pairs, monotone_points


def test_step_cost_interpolates_measured_sizes_and_stays_monotone() -> None:
    cost = StepCost()
    assert cost.seconds(1, 1) is None
    for _ in range(3):
        cost.observe(1, 1, 0.1)
        cost.observe(64, 1, 0.74)
    assert cost.seconds(1, 1) == pytest.approx(0.1)
    assert cost.seconds(64, 1) == pytest.approx(0.74)
    assert cost.seconds(32, 1) == pytest.approx(0.1 + 0.64 * 31 / 63)          # between the two points
    assert cost.seconds(128, 1) == pytest.approx(0.74 * 2)                     # beyond: in proportion to n
    cost.observe(16, 1, 0.05)                                                  # noise: cheaper than 1 token
    assert cost.seconds(16, 1) >= cost.seconds(1, 1)
    sizes = [cost.seconds(n, 1) for n in range(1, 300)]
    assert sizes == sorted(sizes)
    assert cost.seconds(1, 2) is None                                          # per thread count


def test_step_cost_follows_recent_steps() -> None:
    cost = StepCost()
    cost.observe(8, 1, 1.0)
    for _ in range(100):
        cost.observe(8, 1, 0.2)
    assert cost.seconds(8, 1) == pytest.approx(0.2, rel=0.01)


def test_one_cold_step_does_not_price_every_larger_step_for_the_rest_of_the_run() -> None:
    """A stack's first 3-token verify ran cold (83 ms beside a draft warm-up); then the engine ran 1-token steps and
    5-token steps (a decode beside 4 prompt tokens) at their real costs. The 5-token steps are priced at what they
    cost, not at the cold step's 83 ms (bench.stall: every step beside a long prompt held to the 4-token floor)."""
    cost = StepCost()
    cost.observe(3, 2, 0.083)
    for _ in range(70):
        cost.observe(1, 2, 0.035)
    for _ in range(30):
        cost.observe(5, 2, 0.046)
    assert cost.seconds(5, 2) == pytest.approx(0.046, rel=0.02)
    assert cost.seconds(3, 2) <= cost.seconds(5, 2)
    sizes = [cost.seconds(n, 2) for n in range(1, 64)]
    assert sizes == sorted(sizes)


def test_monotone_points_pool_violators_by_weight() -> None:
    # A light, dear bucket between two heavy ones: it takes (nearly) the heavier neighbour's value.
    fitted = monotone_points([(1.0, 0.035, 10.0), (3.0, 0.083, 0.01), (5.0, 0.046, 10.0), (12.0, 0.07, 5.0)])
    assert [n for n, _ in fitted] == [1.0, 3.0, 5.0, 12.0]
    values = [t for _, t in fitted]
    assert values == sorted(values)
    assert values[1] == values[2] == pytest.approx((0.083 * 0.01 + 0.046 * 10) / 10.01)
    assert values[0] == 0.035 and values[3] == 0.07
    # Equal weights: the mean of the pool; several violators in a row pool together.
    assert [t for _, t in monotone_points([(1, 3.0, 1.0), (2, 2.0, 1.0), (3, 1.0, 1.0)])] == [2.0, 2.0, 2.0]


def test_step_cost_separates_what_an_attention_pair_costs_from_what_a_token_costs() -> None:
    """Steps of the same sizes at different positions of a long prompt (t = 50 ms + 10 ms a token + 2 us a pair):
    the fit recovers the pair's price, and predicts a step early and late in the prompt."""
    def truth(n: int, pairs: int) -> float:
        return 0.05 + 0.01 * n + 2e-6 * pairs

    cost = StepCost()
    assert cost.pair_seconds(1) == 0.0
    for start in range(0, 4096, 256):
        for n in (1, 16, 100, 300, 511):
            pairs = attention_pairs(start, n)
            cost.observe(n, 1, truth(n, pairs), pairs)
    assert cost.pair_seconds(1) == pytest.approx(2e-6, rel=1e-3)
    for start, n in ((0, 100), (3500, 300), (40, 16)):
        pairs = attention_pairs(start, n)
        predicted = cost.seconds(n, 1) + cost.pair_seconds(1) * pairs
        assert predicted == pytest.approx(truth(n, pairs), rel=1e-3)


def test_step_cost_does_not_invent_a_price_for_pairs() -> None:
    """Steps whose cost is their tokens' alone, though their pairs grow with the square of their size (every one
    from position 0) and with position (decodes late in a context): pairs are priced at nothing."""
    cost = StepCost()
    for start in (0, 0, 0, 500, 2000):
        for n in (1, 8, 12, 64, 100, 300, 500):
            cost.observe(n, 1, 0.1 + 0.01 * n, attention_pairs(start, n))
    assert cost.pair_seconds(1) == pytest.approx(0.0, abs=1e-12)
    assert cost.seconds(64, 1) == pytest.approx(0.1 + 0.64)
