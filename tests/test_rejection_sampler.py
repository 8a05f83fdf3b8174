"""Tests for specmesh.spec.rejection (sampling helpers: tests/test_sampling.py).

The statistical tests check losslessness of speculative sampling: for every position j,
conditioned on the first j drafts being accepted, the emitted token emitted[j] must be
distributed exactly as the processed target distribution p_j. Negative controls run the
same harness on deliberately broken samplers to show that the statistics can fail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specmesh.spec.rejection import (
    SparseDist,
    num_accepted,
    rejection_sample,
    verify_greedy,
)
from specmesh.spec.sampling import (
    SamplingParams,
    logits_to_probs,
    make_generator,
    sample,
    sample_sparse,
    sparsify,
)
from tests.chi_square import MIN_PVALUE, fit

V = 8
K = 2
N_TRIALS = 6_000

# Fixed logits: row i of the target is p_i, row i of the draft is q_i (different from p_i).
TARGET_LOGITS = torch.tensor(
    [
        [1.2, 0.3, 2.0, -0.5, 0.9, 1.6, -1.0, 0.1],
        [0.0, 1.8, -0.7, 1.1, 0.4, -0.2, 1.5, 0.6],
        [0.7, -0.3, 0.2, 1.9, -1.2, 1.0, 0.5, 1.4],
    ]
)
DRAFT_LOGITS = torch.tensor(
    [
        [1.9, 0.8, 1.2, 0.4, -0.3, 1.0, 0.2, -0.6],
        [0.5, 1.0, 0.3, 1.6, 1.1, -0.9, 0.7, 0.0],
    ]
)

Sampler = Callable[[torch.Tensor, Sequence[int], Sequence[SparseDist], torch.Generator], list[int]]


@dataclass(frozen=True)
class Case:
    target: torch.Tensor  # [K+1, V] processed target probs
    drafts: tuple[SparseDist, ...]  # K sparse draft distributions; drafts are sampled from them


def _dense_case(params: SamplingParams, max_entries: int = V) -> Case:
    """Target and draft processed by the same logits_to_probs; q optionally truncated."""
    p = logits_to_probs(TARGET_LOGITS, params)
    q = logits_to_probs(DRAFT_LOGITS, params)
    return Case(p, tuple(SparseDist(*sparsify(q[i], max_entries)) for i in range(K)))


def _one_hot_case(params: SamplingParams, tokens: tuple[int, int]) -> Case:
    p = logits_to_probs(TARGET_LOGITS, params)
    return Case(p, tuple(SparseDist([t], [1.0]) for t in tokens))


def _run_trials(sampler: Sampler, case: Case, n: int, seed: int) -> list[list[int]]:
    """n independent speculative steps sharing one generator (drafts drawn from q)."""
    gen = make_generator(seed)
    out = []
    for _ in range(n):
        drafts = [sample_sparse(list(d.token_ids), list(d.probs), gen) for d in case.drafts]
        out.append(sampler(case.target, drafts, case.drafts, gen))
    return out


def _position_counts(emitted: list[list[int]], j: int) -> torch.Tensor:
    """Counts [V] of emitted[j] over the trials in which the first j drafts were accepted."""
    counts = torch.zeros(V, dtype=torch.float64)
    for e in emitted:
        if len(e) > j:
            counts[e[j]] += 1
    return counts


def _assert_lossless(emitted: list[list[int]], target: torch.Tensor, min_n: int = 1000) -> None:
    checked = 0
    for j in range(target.shape[0]):
        counts = _position_counts(emitted, j)
        if counts.sum() < min_n:
            continue
        pvalue, tv = fit(counts, target[j])
        assert pvalue > MIN_PVALUE, f"position {j}: p-value {pvalue:.2e}, TV {tv:.4f}"
        checked += 1
    assert checked >= 1


# ---------------------------------------------------------------- greedy verification


def _logits_with_argmax(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    for i, t in enumerate(argmaxes):
        logits[i, t] = 5.0
    return logits


def test_verify_greedy_all_accepted_emits_bonus() -> None:
    assert verify_greedy(_logits_with_argmax([2, 5, 1]), [2, 5]) == [2, 5, 1]


def test_verify_greedy_first_mismatch() -> None:
    logits = _logits_with_argmax([2, 5, 1])
    assert verify_greedy(logits, [2, 4]) == [2, 5]
    assert verify_greedy(logits, [3, 5]) == [2]  # later matches do not count
    assert verify_greedy(_logits_with_argmax([4]), []) == [4]


def test_verify_greedy_ties_pick_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    assert verify_greedy(logits, [2]) == [1]
    assert verify_greedy(logits, [1]) == [1, 0]


def test_verify_greedy_validation() -> None:
    with pytest.raises(ValueError):
        verify_greedy(_logits_with_argmax([1, 2]), [1, 2])  # needs k+1 rows
    with pytest.raises(ValueError):
        verify_greedy(_logits_with_argmax([1, 2]), [9])  # out of vocabulary
    with pytest.raises(ValueError):
        verify_greedy(torch.zeros(6), [])


# ---------------------------------------------------------------- rejection sampling: exact cases


def test_sparse_dist_validation() -> None:
    assert SparseDist([3], [1.0]).token_ids == (3,)
    for ids, ps in (([1, 2], [1.0]), ([], []), ([1, 1], [0.5, 0.5]), ([-1], [1.0]), ([1], [-0.5])):
        with pytest.raises(ValueError):
            SparseDist(ids, ps)
    with pytest.raises(ValueError):
        SparseDist([9], [1.0]).dense(4)


def test_rejection_sample_validation() -> None:
    p = torch.full((2, 4), 0.25)
    gen = make_generator(0)
    one_hot = SparseDist([0], [1.0])
    with pytest.raises(ValueError):
        rejection_sample(p, [0, 1], [one_hot, one_hot], gen)  # 2 drafts need 3 rows
    with pytest.raises(ValueError):
        rejection_sample(p, [0], [], gen)
    with pytest.raises(ValueError):
        rejection_sample(p, [7], [one_hot], gen)


def test_identical_draft_is_always_accepted() -> None:
    case = _dense_case(SamplingParams(temperature=1.0))
    same = Case(case.target, tuple(SparseDist(*sparsify(case.target[i], V)) for i in range(K)))
    assert all(len(e) == K + 1 for e in _run_trials(rejection_sample, same, 300, seed=3))


def test_zero_draft_probability_is_rejected() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    emitted = rejection_sample(p, [1], [SparseDist([0, 2], [0.5, 0.5])], make_generator(0))
    assert emitted == [1] and num_accepted(emitted) == 0


def test_zero_residual_falls_back_to_target() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = SparseDist([0, 1], [1.0, 1.0])  # malformed (mass 2): q >= p everywhere
    gen = make_generator(4)
    emitted = [rejection_sample(p, [0], [q], gen) for _ in range(200)]
    rejected = [e[0] for e in emitted if len(e) == 1]
    assert rejected and set(rejected) <= {0, 1}


def test_same_seed_same_output() -> None:
    case = _dense_case(SamplingParams(temperature=1.0))
    assert _run_trials(rejection_sample, case, 50, seed=9) == _run_trials(rejection_sample, case, 50, seed=9)


def test_num_accepted() -> None:
    assert num_accepted([4]) == 0 and num_accepted([1, 2, 3]) == 2
    with pytest.raises(ValueError):
        num_accepted([])


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    k=st.integers(min_value=0, max_value=3),
    vocab=st.integers(min_value=1, max_value=6),
)
def test_rejection_sample_structure(data: st.DataObject, k: int, vocab: int) -> None:
    weights = st.lists(st.floats(0.0, 1.0), min_size=vocab, max_size=vocab).filter(lambda w: sum(w) > 1e-3)
    p = torch.tensor([data.draw(weights) for _ in range(k + 1)], dtype=torch.float64)
    p = p / p.sum(-1, keepdim=True)
    dists = [SparseDist(*sparsify(torch.tensor(data.draw(weights)), vocab)) for _ in range(k)]
    drafts = [data.draw(st.sampled_from(d.token_ids)) for d in dists]
    emitted = rejection_sample(p, drafts, dists, make_generator(data.draw(st.integers(0, 99))))
    n = num_accepted(emitted)
    assert 0 <= n <= k and emitted[:n] == drafts[:n]
    assert p[n, emitted[-1]] > 0  # the target token always lies in p's support


# ---------------------------------------------------------------- rejection sampling: statistics

STAT_CASES = {
    "temperature_1.0": lambda: _dense_case(SamplingParams(temperature=1.0)),
    "temperature_0.7": lambda: _dense_case(SamplingParams(temperature=0.7)),
    "top_p_0.8": lambda: _dense_case(SamplingParams(temperature=1.0, top_p=0.8)),
    "top_k_3": lambda: _dense_case(SamplingParams(temperature=1.0, top_k=3)),
    "sparse_q_2": lambda: _dense_case(SamplingParams(temperature=1.0), max_entries=2),
    "one_hot": lambda: _one_hot_case(SamplingParams(temperature=1.0), (2, 1)),
}


@pytest.mark.parametrize("name", list(STAT_CASES))
def test_rejection_sampler_is_lossless(name: str) -> None:
    case = STAT_CASES[name]()
    emitted = _run_trials(rejection_sample, case, N_TRIALS, seed=1234)
    _assert_lossless(emitted, case.target)
    # Enough acceptances that the conditional second-token law is actually tested.
    assert _position_counts(emitted, 1).sum() >= 1000


def test_one_hot_draft_outside_top_k_support() -> None:
    params = SamplingParams(temperature=1.0, top_k=3)
    case = _one_hot_case(params, (6, 1))  # token 6 is outside p_0's top-3
    assert case.target[0, 6] == 0.0
    emitted = _run_trials(rejection_sample, case, 3000, seed=5)
    assert all(len(e) == 1 for e in emitted)  # never accepted
    _assert_lossless(emitted, case.target)


# ---------------------------------------------------------------- negative controls


def _always_accept(
    p: torch.Tensor, drafts: Sequence[int], dists: Sequence[SparseDist], gen: torch.Generator
) -> list[int]:
    return [*drafts, sample(p[len(drafts)], gen)]


def _resample_from_p(
    p: torch.Tensor, drafts: Sequence[int], dists: Sequence[SparseDist], gen: torch.Generator
) -> list[int]:
    """Bug: after a rejection, sample from p_i instead of the residual max(0, p_i - q_i)."""
    out: list[int] = []
    for i, (d, dist) in enumerate(zip(drafts, dists, strict=True)):
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if u < float(p[i, d]) / dist.prob(d):
            out.append(d)
            continue
        return [*out, sample(p[i], gen)]
    return [*out, sample(p[len(drafts)], gen)]


@pytest.mark.parametrize("broken", [_always_accept, _resample_from_p])
def test_statistics_detect_broken_samplers(broken: Sampler) -> None:
    case = STAT_CASES["temperature_1.0"]()
    emitted = _run_trials(broken, case, 3000, seed=1234)
    pvalue, tv = fit(_position_counts(emitted, 0), case.target[0])
    assert pvalue < 1e-6 and tv > 0.03
    with pytest.raises(AssertionError):
        _assert_lossless(emitted, case.target)
