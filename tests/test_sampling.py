"""Tests for specmesh.spec.sampling: sampling parameters, logits -> probabilities, and the sampling helpers."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specmesh.spec import sampling
from specmesh.spec.sampling import (
    SamplingParams,
    inverse_cdf_index,
    logits_to_probs,
    make_generator,
    sample,
    sample_sparse,
    sparsify,
)
from tests.chi_square import MIN_PVALUE, fit

# ---------------------------------------------------------------- SamplingParams / logits_to_probs


def test_sampling_params_validation_and_greedy() -> None:
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    for bad in (
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_temperature_exact() -> None:
    logits = torch.tensor([[0.0, math.log(2.0)]])
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0)), torch.tensor([[1 / 3, 2 / 3]]))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=0.5)), torch.tensor([[0.2, 0.8]]))


def test_top_k_exact_and_ties() -> None:
    probs = logits_to_probs(torch.tensor([[3.0, 1.0, 2.0, 0.0]]), SamplingParams(1.0, top_k=2))
    e3, e2 = math.exp(3.0), math.exp(2.0)
    torch.testing.assert_close(probs, torch.tensor([[e3 / (e3 + e2), 0.0, e2 / (e3 + e2), 0.0]]))
    # Ties at the top-k boundary keep the lowest token ids.
    tied = logits_to_probs(torch.tensor([[2.0, 2.0, 1.0, 1.0]]), SamplingParams(1.0, top_k=3))
    assert tied[0, 3] == 0.0 and bool((tied[0, :3] > 0).all())
    assert logits_to_probs(torch.tensor([[1.0, 2.0]]), SamplingParams(1.0, top_k=5)).gt(0).all()


def test_top_p_exact() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()

    def run(top_p: float, top_k: int = 0) -> torch.Tensor:
        return logits_to_probs(logits, SamplingParams(1.0, top_p=top_p, top_k=top_k))[0]

    torch.testing.assert_close(run(0.75), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(run(0.85), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    torch.testing.assert_close(run(0.01), torch.tensor([1.0, 0.0, 0.0, 0.0]))  # top token kept
    torch.testing.assert_close(run(1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(run(0.9, top_k=2), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(run(0.6, top_k=2), torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_greedy_one_hot_ties_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0], [5.0, 0.0, 5.0]], dtype=torch.bfloat16)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=1))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_logits_to_probs_dtypes_masks_and_errors() -> None:
    logits = torch.tensor([[0.0, -math.inf, 1.0], [2.0, 2.0, 2.0]], dtype=torch.float16)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.9))
    assert probs.dtype == torch.float32 and probs.shape == (2, 3)
    assert probs[0, 1] == 0.0
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(4), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError):
        logits_to_probs(torch.full((1, 3), -math.inf), SamplingParams(temperature=1.0))


# ---------------------------------------------------------------- sampling helpers


def test_make_generator_is_deterministic() -> None:
    a, b = make_generator(7), make_generator(7)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert isinstance(make_generator(None), torch.Generator)


def test_sample_matches_distribution() -> None:
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    gen = make_generator(1)
    counts = torch.zeros(4, dtype=torch.float64)
    for _ in range(6000):
        counts[sample(probs, gen)] += 1
    assert counts[1] == 0
    assert fit(counts, probs)[0] > MIN_PVALUE
    for bad in (torch.zeros(3), torch.tensor([0.5, -0.1, 0.6]), torch.ones(2, 2)):
        with pytest.raises(ValueError):
            sample(bad, gen)


def test_inverse_cdf_skips_zero_weights_at_edges() -> None:
    w = torch.tensor([0.0, 0.5, 0.5, 0.0], dtype=torch.float64)
    assert inverse_cdf_index(w, 0.0) == 1
    assert inverse_cdf_index(w, 0.49) == 1
    assert inverse_cdf_index(w, 0.5) == 2
    assert inverse_cdf_index(w, 1.0) == 2  # rounding at the top never lands on a zero entry


def test_sparsify_renormalizes_and_respects_max_entries() -> None:
    probs = torch.tensor([0.1, 0.4, 0.0, 0.3, 0.2])
    ids, ps = sparsify(probs, 2)
    assert ids == [1, 3]
    assert ps == pytest.approx([4 / 7, 3 / 7], abs=1e-7)
    assert math.isclose(sum(ps), 1.0, abs_tol=1e-12)
    ids, ps = sparsify(probs, 10)  # zero entries are dropped
    assert ids == [1, 3, 4, 0] and len(ps) == 4 and math.isclose(sum(ps), 1.0, abs_tol=1e-12)
    assert sparsify(torch.tensor([0.25, 0.5, 0.25]), 2)[0] == [1, 0]  # ties -> lowest id
    for bad_probs, bad_n in ((probs, 0), (torch.zeros(3), 2), (torch.ones(2, 2), 1)):
        with pytest.raises(ValueError):
            sparsify(bad_probs, bad_n)


def test_sample_sparse_distribution_and_errors() -> None:
    gen = make_generator(2)
    ids, ps = [5, 2, 7], [0.5, 0.0, 0.5]
    draws = [sample_sparse(ids, ps, gen) for _ in range(4000)]
    assert set(draws) == {5, 7}
    assert abs(draws.count(5) / 4000 - 0.5) < 0.04
    for bad_ids, bad_ps in (([1], [0.5, 0.5]), ([], []), ([1, 2], [0.0, 0.0]), ([1], [-1.0])):
        with pytest.raises(ValueError):
            sample_sparse(bad_ids, bad_ps, gen)


def test_top_k_top_p_from_the_most_likely_candidates_equal_the_full_sort() -> None:
    """Rows ranked from their NUM_CANDIDATES most likely tokens keep exactly the tokens a sort of the whole vocabulary
    keeps: peaked and flat rows, ties at the candidates' edge, nuclei that end inside the candidates and past them."""
    generator = torch.Generator().manual_seed(0)
    num_vocab = 3 * sampling.NUM_CANDIDATES
    rows = [torch.randn(num_vocab, generator=generator, dtype=torch.float64) * scale for scale in (0.1, 1.0, 4.0, 12.0)]
    tied = torch.zeros(num_vocab, dtype=torch.float64)
    tied[: sampling.NUM_CANDIDATES + 50] = 1.0                  # ties across the candidates' last place
    rows += [tied, torch.linspace(0.0, 1.0, num_vocab, dtype=torch.float64).flip(0)]
    decided_by_candidates = sorted_whole = 0
    for logits in rows:
        probs = torch.softmax(logits, dim=-1)
        top_ks = (0, 1, 7, 40, sampling.NUM_CANDIDATES + 10, num_vocab)
        for top_k, top_p in itertools.product(top_ks, (1.0, 0.5, 0.9, 0.999)):
            if not top_k and top_p == 1.0:
                continue
            k = top_k if top_k < num_vocab else 0
            full = torch.zeros(num_vocab, dtype=torch.bool)
            full[sampling._kept_by_full_sort(probs, k, top_p)] = True
            fast = sampling._filter_top_k_top_p(probs[None], top_k, top_p)[0] > 0
            assert torch.equal(fast, full), (top_k, top_p, int(fast.sum()), int(full.sum()))
            if sampling._top_ranked(probs, k, top_p) is None:
                sorted_whole += 1
            else:
                decided_by_candidates += 1
    assert decided_by_candidates > 40 and sorted_whole > 5     # both ways were taken
