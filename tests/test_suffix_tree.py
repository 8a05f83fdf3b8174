"""Suffix drafting on plain ints, no Redis, no models: the request's context index (longest match, counts), the
tries and the proposals grown from them (chains, trees, scores), merging suffix branches into a model draft, and
the per-round choice between proposers."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.draft_link import DraftLink
from gateway.proposers.base import Draft, VerifiedTokens
from gateway.proposers.compose import build_policy
from gateway.proposers.cost_model import RoundObservation
from gateway.proposers.policy import ProposerPolicy
from gateway.proposers.suffix_rule import with_branches
from gateway.suffix_choice import GLOBAL, LOCAL, MODEL, NONE, PROBE_BUDGET, PROBE_EVERY, ProposerChoice, depths
from gateway.suffix_index import ContextIndex
from gateway.suffix_tree import CountNode, accepted_nodes, merge_tries, speculate, trie_from_continuations
from gateway.tiers import DraftTiers, TierSettings
from gateway.verify_cost import VerifyCost
from protos.specmesh.v1 import common_pb2
from specmesh.spec.rejection import SparseDist

MODEL_SOURCE = common_pb2.DRAFT_SOURCE_MODEL


def index_of(tokens: list[int], **kwargs: int) -> ContextIndex:
    index = ContextIndex(**kwargs)
    index.sync(tokens)
    return index


def brute_match(tokens: list[int], max_match: int) -> tuple[int, list[int]]:
    """Longest suffix (<= max_match) that also ends at an earlier position; those end positions, latest first."""
    n = len(tokens)
    for length in range(min(max_match, n - 1), 0, -1):
        tail = tokens[n - length:]
        ends = [i for i in range(n - 2, length - 2, -1) if tokens[i - length + 1:i + 1] == tail]
        if ends:
            return length, ends
    return 0, []


def test_longest_match_and_its_continuation_counts() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [7, 1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3, 1, 2, 3]
    index = index_of(tokens)
    assert index.match() == (3, [11, 3])                    # "1 2 3" ended at 11 and 3 (and "2 3" at 7: shorter)
    trie, length = index.trie(2)
    assert length == 3 and trie.count == 2
    assert {t: c.count for t, c in trie.children.items()} == {1: 1, 9: 1}
    assert {t: c.count for t, c in trie.children[1].children.items()} == {2: 1}
    assert index_of([1, 2, 3, 4]).match() == (0, [])
    assert index_of([5]).match() == (0, [])


def test_sync_appends_and_rebuilds_when_the_context_is_not_an_extension() -> None:
    index = index_of([1, 2, 3])
    index.sync([1, 2, 3, 1, 2])
    assert index.match() == (2, [1])
    index.sync([9, 9])                                      # not an extension: start over
    assert index.tokens == [9, 9] and index.match() == (1, [0])


@given(st.lists(st.integers(0, 4), max_size=80), st.integers(1, 6))
def test_match_equals_brute_force(tokens: list[int], max_match: int) -> None:
    assert index_of(tokens, max_match=max_match, max_occurrences=1000).match() == brute_match(tokens, max_match)


@given(st.lists(st.integers(0, 3), min_size=2, max_size=60))
def test_trie_counts_are_occurrence_counts(tokens: list[int]) -> None:
    index = index_of(tokens, max_occurrences=1000)
    length, ends = index.match()
    trie, _ = index.trie(3)
    assert trie.count == len(ends)
    for a, child in trie.children.items():                 # count(child) = occurrences of (match, a)
        assert child.count == sum(1 for e in ends if tokens[e + 1] == a)
        assert sum(c.count for c in child.children.values()) <= child.count


def test_trie_from_continuations_sums_counts_through_each_node() -> None:
    trie = trie_from_continuations([([1, 2, 3], 3), ([1, 2, 4], 1), ([5], 2), ([], 9), ([6], 0)])
    assert trie.count == 6
    assert trie.children[1].count == 4 and trie.children[5].count == 2
    assert {t: c.count for t, c in trie.children[1].children[2].children.items()} == {3: 3, 4: 1}
    assert merge_tries([trie, trie]).children[1].children[2].count == 8


def test_chain_follows_the_most_frequent_child_until_the_probability_threshold() -> None:
    trie = trie_from_continuations([([1, 2, 3, 4], 6), ([1, 2, 9], 3), ([7], 1)])
    chain = speculate(trie, 16, min_prob=0.5)
    assert chain.token_ids == [1, 2, 3, 4] and chain.parents == [-1, 0, 1, 2] and chain.is_chain
    assert chain.probs == pytest.approx([0.9, 0.9, 0.6, 0.6])
    assert chain.score == pytest.approx(3.0)               # expected accepted tokens: sum of path probabilities
    assert speculate(trie, 16, min_prob=0.7).token_ids == [1, 2]
    assert speculate(trie, 3, min_prob=0.0).token_ids == [1, 2, 3]
    assert speculate(CountNode(), 8).token_ids == []


def test_match_length_bounds_the_draft() -> None:
    trie = trie_from_continuations([(list(range(20)), 5)])
    assert len(speculate(trie, 16, match_len=1).token_ids) == 2           # SPEC_FACTOR = 2 tokens per matched one
    assert len(speculate(trie, 16, match_len=3).token_ids) == 6
    assert len(speculate(trie, 16, match_len=12).token_ids) == 16


def test_tree_output_branches_where_two_continuations_are_frequent() -> None:
    trie = trie_from_continuations([([1, 2, 3], 5), ([1, 4, 5], 4), ([6, 7], 1)])
    tree = speculate(trie, 16, min_prob=0.3, max_branches=2)
    assert list(zip(tree.token_ids, tree.parents, strict=True)) == [(1, -1), (2, 0), (3, 1), (4, 0), (5, 3)]
    assert all(p < i for i, p in enumerate(tree.parents)) and not tree.is_chain
    assert tree.score == pytest.approx(0.9 + 0.5 + 0.5 + 0.4 + 0.4)
    # budget: the most probable nodes first, and a node always after its parent
    small = speculate(trie, 3, min_prob=0.0, max_branches=2)
    assert list(zip(small.token_ids, small.parents, strict=True)) == [(1, -1), (2, 0), (3, 1)]
    assert accepted_nodes(tree, [1, 4, 5, 8]) == [0, 3, 4]
    assert accepted_nodes(tree, [6]) == []


def test_model_draft_carries_the_suffix_proposal_as_branches() -> None:
    trie = trie_from_continuations([([1, 2, 3], 5), ([1, 4], 4)])
    suffix = speculate(trie, 8, min_prob=0.0, max_branches=2)          # 1 -> (2 -> 3, 4)
    model = Draft([1, 2, 8], [SparseDist((1,), (1.0,))] * 3, MODEL_SOURCE)
    merged = with_branches(model, suffix)
    assert merged.token_ids == [1, 2, 8, 3, 4] and merged.parents == [-1, 0, 1, 1, 0]
    assert merged.dists is not None and merged.dists[3:] == [SparseDist((3,), (1.0,)), SparseDist((4,), (1.0,))]
    assert merged.source == MODEL_SOURCE
    same = with_branches(Draft([1, 2, 3], None, MODEL_SOURCE), speculate(trie, 8, min_prob=0.0))
    assert same.token_ids == [1, 2, 3] and same.parents is None      # nothing new: the model's chain as is
    other = with_branches(Draft([9], None, MODEL_SOURCE), speculate(trie, 8, min_prob=0.0))
    assert other.token_ids == [9, 1, 2, 3] and other.parents == [-1, -1, 1, 2]


def test_choice_prefers_free_suffix_drafts_when_the_model_is_slow() -> None:
    choice = ProposerChoice()
    for _ in range(5):
        choice.observe_verify(4, 0.15)
        choice.observe_cost(MODEL, 0.24)                   # 4 tokens of a slow draft model
        choice.observe_model(4, 2, 0.24, 0.15)
        choice.observe_cost(LOCAL, 0.0001)
    model = (choice.expected_model(4), 4)
    assert 0.5 < model[0] < 2.0
    assert choice.choose({LOCAL: (1.0, 3), MODEL: model}) == LOCAL
    assert choice.choose({MODEL: model}) == NONE           # target-only beats a slow, half-right model
    fast = ProposerChoice()
    for _ in range(5):
        fast.observe_verify(4, 0.15)
        fast.observe_cost(MODEL, 0.01)
        fast.observe_model(4, 4, 0.01, 0.15)               # a fast draft model that is always right
    assert fast.expected_model(4) > 3.0
    assert fast.choose({LOCAL: (1.0, 3), MODEL: (fast.expected_model(4), 4)}) == MODEL


def test_choice_calibrates_each_suffix_proposer_per_depth() -> None:
    chain = speculate(trie_from_continuations([([1, 2, 3, 4], 1)]), 4, min_prob=0.0)   # 4 nodes, p = 1 each
    choice = ProposerChoice()
    assert choice.expected_suffix(LOCAL, chain) == pytest.approx(4.0)                   # uncalibrated: the score
    for _ in range(10):
        choice.observe_suffix(GLOBAL, chain, [])           # the shared store's drafts keep failing at once
        choice.observe_suffix(LOCAL, chain, [0, 1])        # the local ones hold for two tokens
    assert choice.expected_suffix(GLOBAL, chain) < 0.5
    assert choice.expected_suffix(LOCAL, chain) == pytest.approx(2.0, abs=0.6)
    local = ProposerChoice()._calibration[LOCAL]
    for _ in range(10):
        local.add(chain, [0, 1])
    assert local.at(1) > 0.8 and local.at(2) > 0.8 and local.at(3) < 0.3 and local.at(4) < 0.3
    assert depths([-1, 0, 1, 0, -1, 4]) == [1, 2, 3, 2, 1, 2]


def test_choice_probes_an_unchosen_proposer() -> None:
    choice = ProposerChoice()
    for _ in range(5):
        choice.observe_model(4, 0, 0.3, 0.15)
        choice.observe_cost(MODEL, 0.3)
    options = {LOCAL: (3.0, 4), MODEL: (choice.expected_model(4), 4)}
    picks = Counter(choice.choose(options) for _ in range(3 * (PROBE_EVERY + 1)))
    assert picks[MODEL] == 3 and picks[LOCAL] == 3 * PROBE_EVERY


def test_a_dear_proposer_is_probed_less_often() -> None:
    """Probes take at most PROBE_BUDGET of the time: a model round costing 0.32 s beyond an 0.08 s target-only round
    is tried once in 40 rounds, not once in 17."""
    choice = ProposerChoice()
    for _ in range(40):
        choice.observe_verify(0, 0.08)
        choice.observe_model(4, 0, 0.3, 0.1)
        choice.observe_cost(MODEL, 0.3)
    options = {MODEL: (choice.expected_model(4), 4)}
    assert choice.round_s(MODEL, 4) - choice.round_s(NONE, 0) == pytest.approx(0.32, rel=0.05)
    picks = [choice.choose(options) for _ in range(200)]
    probes = [i for i, p in enumerate(picks) if p == MODEL]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert len(probes) >= 4 and all(38 <= g <= 44 for g in gaps), gaps
    assert 0.32 / (gaps[0] * choice.round_s(NONE, 0)) <= PROBE_BUDGET * 1.05


class _BackingOffModel:
    """A draft model whose link failed: `link.backoff_rounds` rounds without model drafts, then it drafts."""

    def __init__(self, backoff_rounds: int) -> None:
        self.link = DraftLink(bound=True)           # prefilled beside the verifier, as a request alone is
        self.link.backoff_rounds = backoff_rounds
        self.num_calls = self.num_prefetch_hits = self.bytes_sent = self.bytes_received = 0
        self.tree_width, self.tree_pricing = 0, None      # (the ModelProposer protocol: chains)

    @property
    def skip_rounds(self) -> int:
        return self.link.backoff_rounds

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        self.num_calls += 1
        self.link.send(context_ids)                 # the service holds the context now (ModelDrafter.propose)
        return Draft([7] * num_tokens, None, common_pb2.DRAFT_SOURCE_MODEL)


async def test_suffix_drafting_gives_the_model_back_after_a_draft_link_backoff() -> None:
    """Regression: the suffix proposer never asked a backing-off model, so its backoff never ran down and one draft
    service failure left the rest of the request undrafted (seen as 30 target-only rounds on a code prompt)."""
    model = _BackingOffModel(backoff_rounds=3)
    tiers = DraftTiers(TierSettings(vocab_size=512, suffix_drafting=True), None)
    drafter = build_policy(tiers, model, "t")  # type: ignore[arg-type]
    for _ in range(3):
        assert not (await drafter.propose([1, 2, 3, 9], 4, 62)).token_ids
    assert model.num_calls == 0 and model.skip_rounds == 0
    draft = await drafter.propose([1, 2, 3, 9], 4, 62)
    assert model.num_calls == 1 and draft.token_ids == [7, 7, 7, 7]


class _TreeModel(_BackingOffModel):
    """A draft model that returns a chain of 3 and one alternative leaf at position 1 (the draft service's tree),
    and leaves pricing its tree width to whoever sets `tree_pricing`."""

    def __init__(self) -> None:
        super().__init__(backoff_rounds=0)
        self.tree_width, self.tree_pricing = 1, None

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        self.num_calls += 1
        self.link.send(context_ids)
        return Draft([7, 8, 9, 5], None, common_pb2.DRAFT_SOURCE_MODEL, [-1, 0, 1, 0])


def _verified(drafter: ProposerPolicy, draft: Draft, num_accepted: int, output: list[int], cost: VerifyCost) -> None:
    """What the round loop does with a verdict: the cost model learns from it once, then the drafter's bookkeeping.
    `output` ends with the round's accepted drafts and the target's own token."""
    accepted = tuple(output[len(output) - num_accepted - 1:-1])
    drafter.cost_model.observe(RoundObservation(draft.source, len(draft.token_ids), num_accepted, 0.0, 0.001, cost,
                                                accepted_ids=accepted, draft=draft))
    drafter.observe(draft, num_accepted, VerifiedTokens([1, 2, 3], list(output)), cost)


async def test_the_choice_learns_the_models_chain_and_its_tree_alternatives_apart() -> None:
    """Regression: a tree from the draft service was scored as a 4-token chain, so its alternative leaf read as a
    rejected chain token (acceptance diluted); and with no adaptive draft length its width went unpriced."""
    model = _TreeModel()
    tiers = DraftTiers(TierSettings(vocab_size=512, suffix_drafting=True), None)
    drafter = build_policy(tiers, model, "t")  # type: ignore[arg-type]
    assert model.tree_pricing == drafter.cost_model.tree_width         # the suffix drafter prices the width
    output: list[int] = []
    for i in range(8):                                                 # the whole chain is accepted every time
        draft = await drafter.propose([1, 2, 3, *output], 4, 63 - len(output))
        assert draft.parents == [-1, 0, 1, 0]
        output += [7, 8, 9, 100 + i]                                   # the chain, then the target's own token
        _verified(drafter, draft, 3, output, VerifyCost(0.4))
    assert drafter.cost_model.choice.model.acceptance() > 0.9
    missed = drafter.cost_model.choice.model.alternative_hit_rate()
    assert missed < 0.15                                               # the alternative never hit (prior: 0.2)
    draft = await drafter.propose([1, 2, 3, *output], 4, 63 - len(output))
    output += [7, 5, 200]                                              # now it did: 7, then the alternative 5
    _verified(drafter, draft, 2, output, VerifyCost(0.4))
    assert drafter.cost_model.choice.model.alternative_hit_rate() > missed
