"""Seeded sampling (specmesh/spec/seeded.py): exact in distribution, and the emitted sequence does not depend on drafts.

The model here is a toy: the target's distribution after a context is a fixed function of the context, so the
sequence k = 0 decoding emits is the reference, and verifying any chain or tree of drafts must emit exactly it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specmesh.spec.seeded import accept_chain, accept_tree, exponentials, seeded_sparse, seeded_token
from specmesh.spec.tree import depths
from tests.chi_square import MIN_PVALUE, fit

VOCAB = 6


def toy_probs(context: tuple[int, ...], temperature: float = 1.0) -> torch.Tensor:
    """A target (or draft, with another temperature) distribution [VOCAB] that depends on the whole context."""
    gen = torch.Generator().manual_seed(hash(context) & 0xFFFFFFFF)
    return torch.softmax(torch.randn(VOCAB, generator=gen, dtype=torch.float64) / temperature, dim=-1)


def reference(seed: int, prompt: tuple[int, ...], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        context = prompt + tuple(out)
        out.append(seeded_token(toy_probs(context), seed, len(context)))
    return out


def test_noise_is_keyed_by_seed_position_and_token_alone() -> None:
    ids = np.arange(1000, dtype=np.int64)
    e = exponentials(7, 3, ids)
    assert np.array_equal(e[:10], exponentials(7, 3, ids[:10]))            # no dependence on the vocabulary size
    assert np.array_equal(e[[5, 900]], exponentials(7, 3, np.array([5, 900])))
    assert not np.array_equal(e, exponentials(7, 4, ids)) and not np.array_equal(e, exponentials(8, 3, ids))
    assert (e > 0).all() and abs(float(e.mean()) - 1.0) < 0.1                # Exp(1)


@pytest.mark.parametrize("position", [0, 17])
def test_seeded_token_follows_p(position: int) -> None:
    probs = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.1, 0.0], dtype=torch.float32)
    counts = torch.zeros(VOCAB)
    for seed in range(4000):
        counts[seeded_token(probs, seed, position)] += 1
    pvalue, _ = fit(counts, probs)
    assert pvalue > MIN_PVALUE, counts


def test_consecutive_positions_are_independent() -> None:
    probs = torch.tensor([0.5, 0.5])
    pairs = torch.zeros(4)
    for seed in range(4000):
        pairs[2 * seeded_token(probs, seed, 10) + seeded_token(probs, seed, 11)] += 1
    assert fit(pairs, torch.full((4,), 0.25))[0] > MIN_PVALUE, pairs


def test_sparse_draw_equals_the_dense_draw_on_its_support() -> None:
    probs = torch.tensor([0.0, 0.4, 0.1, 0.0, 0.3, 0.2])
    for seed in range(200):
        assert seeded_sparse([4, 1, 5, 2], [0.3, 0.4, 0.2, 0.1], seed, 5) == seeded_token(probs, seed, 5)


def _draft_chain(seed: int, context: tuple[int, ...], k: int, rng: random.Random) -> list[int]:
    """Drafts of three kinds: the coupled draft (same noise, another distribution), random one-hot guesses, or a
    copy of the target's own draws."""
    drafts: list[int] = []
    for _ in range(k):
        ctx = context + tuple(drafts)
        kind = rng.random()
        if kind < 0.5:
            drafts.append(seeded_token(toy_probs(ctx, 1.7), seed, len(ctx)))
        elif kind < 0.8:
            drafts.append(rng.randrange(VOCAB))
        else:
            drafts.append(seeded_token(toy_probs(ctx), seed, len(ctx)))
    return drafts


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_any_chain_schedule_emits_the_target_only_sequence(seed: int) -> None:
    prompt = (1, 2, 3)
    want = reference(seed, prompt, 40)
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < 40:
        context = prompt + tuple(out)
        drafts = _draft_chain(seed, context, rng.randrange(0, 7), rng)
        base = len(context)
        emitted = accept_chain(
            lambda i, ctx=context, d=drafts, b=base: seeded_token(toy_probs(ctx + tuple(d[:i])), seed, b + i), drafts)
        assert emitted[:-1] == drafts[:len(emitted) - 1]             # accepted drafts are a prefix of the drafts
        out += emitted
    assert out[:40] == want


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_tree_emits_the_target_only_sequence(seed: int) -> None:
    prompt = (4, 4)
    want = reference(seed, prompt, 30)
    rng = random.Random(100 + seed)
    out: list[int] = []
    while len(out) < 30:
        context = prompt + tuple(out)
        parents: list[int] = []
        tokens: list[int] = []
        for i in range(rng.randrange(0, 8)):                 # a random tree: each node under an earlier one or root
            parents.append(rng.randrange(-1, i))
            tokens.append(rng.randrange(VOCAB))
        depth = depths(parents)

        def path_context(row: int, ctx: tuple[int, ...] = context, ps: list[int] = parents,
                         ts: list[int] = tokens) -> tuple[int, ...]:
            path: list[int] = []
            node = row - 1
            while node >= 0:
                path.append(ts[node])
                node = ps[node]
            return ctx + tuple(reversed(path))

        accepted, final = accept_tree(
            lambda row, d, b=len(context): seeded_token(toy_probs(path_context(row)), seed, b + d), tokens, parents)
        assert [depth[a] for a in accepted] == list(range(len(accepted)))
        out += [tokens[a] for a in accepted] + [final]
    assert out[:30] == want


def test_coupled_draft_of_the_target_itself_is_always_accepted() -> None:
    drafts_accepted = 0
    for seed in range(50):
        context = (seed % 5,)
        drafts: list[int] = []
        for _ in range(4):
            ctx = context + tuple(drafts)
            drafts.append(seeded_token(toy_probs(ctx), seed, len(ctx)))
        emitted = accept_chain(lambda i, c=context, d=drafts, s=seed: seeded_token(toy_probs(c + tuple(d[:i])), s,
                                                                           len(c) + i), drafts)
        drafts_accepted += len(emitted) - 1
    assert drafts_accepted == 50 * 4


def test_coupled_draft_matches_at_least_as_often_as_the_gumbel_bound() -> None:
    """P(draft token == target token) >= (1 - TV) / (1 + TV) for one position drawn with the same noise."""
    p, q = toy_probs((9,)), toy_probs((9,), 1.6)
    tv = 0.5 * float((p - q).abs().sum())
    n = 4000
    matches = sum(seeded_token(p, seed, 3) == seeded_token(q, seed, 3) for seed in range(n))
    assert matches / n >= (1 - tv) / (1 + tv) - 0.03, (matches / n, tv)
