"""repetition_penalty, logit_bias and min_p: the transforms themselves (against transformers' processors), their
position within a verify block, and exactness of rejection sampling when p and q are both transformed."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from specmesh.spec.logit_transforms import adjust_chain, adjust_logits, adjust_tree, chain_seen, tree_seen
from specmesh.spec.rejection import SparseDist, rejection_sample
from specmesh.spec.sampling import SamplingParams, logits_to_probs, make_generator, sample
from tests.chi_square import MIN_PVALUE, fit


def test_repetition_penalty_equals_transformers_row_by_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    context, drafts = [3, 7, 7, 12], [40, 3, 41]
    params = SamplingParams(temperature=1.0, repetition_penalty=1.5)
    ours = adjust_chain(logits, params, context, drafts)
    processor = RepetitionPenaltyLogitsProcessor(1.5)
    for i in range(4):
        ids = torch.tensor([context + drafts[:i]])
        assert torch.equal(ours[i], processor(ids, logits[i:i + 1].clone())[0]), i
    assert ours[1, 40] != logits[1, 40] and ours[0, 40] == logits[0, 40]      # a draft counts from the next row on


def test_tree_rows_see_their_own_path_only() -> None:
    context = [1, 2]
    tokens, parents = [5, 6, 7, 8], [-1, -1, 0, 2]
    seen = tree_seen(context, tokens, parents, 10)
    paths = {0: [], 1: [5], 2: [6], 3: [5, 7], 4: [5, 7, 8]}
    for row, path in paths.items():
        assert torch.equal(seen[row], chain_seen(context + path, [], 10)[0]), row
    logits = torch.randn(5, 10)
    params = SamplingParams(repetition_penalty=2.0)
    adjusted = adjust_tree(logits, params, context, tokens, parents)
    chain = adjust_chain(logits[[0, 1, 3, 4]], params, context, [5, 7, 8])       # the path 0 -> 2 -> 3 as a chain
    assert torch.equal(adjusted[[0, 1, 3, 4]], chain)


def test_logit_bias_is_added_and_ids_beyond_the_vocabulary_are_ignored() -> None:
    logits = torch.zeros(2, 5)
    out = adjust_logits(logits, SamplingParams(logit_bias=((1, -100.0), (4, 2.5), (9, 1.0))), None)
    assert out.tolist() == [[0, -100, 0, 0, 2.5]] * 2
    assert adjust_logits(logits, SamplingParams(), None) is logits                # nothing to do: no copy


def test_min_p_keeps_what_transformers_keeps() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 40) * 3
    for min_p in (0.05, 0.3, 1.0):
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=min_p))
        theirs = MinPLogitsWarper(min_p)(torch.zeros(3, 1, dtype=torch.long), logits.clone())
        assert torch.equal(probs > 0, torch.isfinite(theirs)), min_p
        assert torch.allclose(probs.sum(-1), torch.ones(3))


def test_greedy_with_penalty_changes_the_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.5]])
    params = SamplingParams(repetition_penalty=1.5)
    assert int(logits_to_probs(adjust_chain(logits, params, [1], []), params).argmax()) == 2


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, min_p=0.15, repetition_penalty=1.8),
    SamplingParams(temperature=0.8, top_k=5, repetition_penalty=0.7, logit_bias=((2, 1.5), (0, -2.0))),
], ids=["min_p+penalty", "top_k+reward+bias"])
def test_rejection_sampling_of_transformed_p_and_q_is_exact(params: SamplingParams) -> None:
    """Toy model: raw logits per row are fixed, so the distribution at row 1 depends on the token at row 0 only
    through the repetition penalty. The draft transforms q exactly as the verifier transforms p; the first two
    emitted tokens must follow the transformed target, the second conditional on the first."""
    torch.manual_seed(2)
    vocab, context = 8, [0, 5]
    target_logits = torch.randn(3, vocab) * 1.5
    draft_logits = target_logits + torch.randn(3, vocab)
    gen = make_generator(123)
    n = 6000
    first: list[int] = []
    second: dict[int, list[int]] = collections.defaultdict(list)
    for _ in range(n):
        drafts: list[int] = []
        dists: list[SparseDist] = []
        for i in range(2):
            q = logits_to_probs(adjust_chain(draft_logits[i:i + 1], params, context + drafts, []), params)[0]
            drafts.append(sample(q, gen))
            dists.append(SparseDist(tuple(range(vocab)), tuple(q.tolist())))
        p = logits_to_probs(adjust_chain(target_logits, params, context, drafts), params)
        emitted = rejection_sample(p, drafts, dists, gen)
        if len(emitted) == 1:     # the second token comes from the next round: draw it from the target directly
            p1 = logits_to_probs(adjust_chain(target_logits[1:2], params, context + emitted, []), params)[0]
            emitted.append(sample(p1, gen))
        first.append(emitted[0])
        second[emitted[0]].append(emitted[1])
    p0 = logits_to_probs(adjust_chain(target_logits[:1], params, context, []), params)[0]
    assert fit(torch.bincount(torch.tensor(first), minlength=vocab).double(), p0)[0] > MIN_PVALUE
    token, seconds = max(second.items(), key=lambda kv: len(kv[1]))
    p1 = logits_to_probs(adjust_chain(target_logits[1:2], params, context + [token], []), params)[0]
    assert fit(torch.bincount(torch.tensor(seconds), minlength=vocab).double(), p1)[0] > MIN_PVALUE
