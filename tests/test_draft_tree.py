"""Tree drafting (GatewayConfig.draft_tree_width): the draft service's alternatives, the gateway's tree, and exact
greedy output through the full tiny stack."""

from __future__ import annotations

import itertools

import grpc
import pytest
import pytest_asyncio
import torch
from transformers import AutoTokenizer

from gateway.draft_tree import build_tree, main_chain_len
from gateway.proposers.base import NO_DRAFT, Draft
from gateway.proposers.draft_model import ModelDrafter
from gateway.round_outcomes import RoundOutcomes, classify
from protos.specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from specmesh.spec.rejection import SparseDist
from specmesh.spec.sampling import SamplingParams
from specmesh.spec.tree import check_parents
from specmesh.spec.tree_rejection import tree_rejection_sample
from tests.chi_square import MIN_PVALUE, fit
from tests.stack import reference_greedy, start_draft, start_gateway, start_verifier

CONTEXT = [(13 * i + 7) % 200 + 10 for i in range(40)]
_ids = itertools.count()


def test_build_tree_puts_alternatives_beside_their_chain_token() -> None:
    ids, parents, dists = build_tree([5, 6, 7], None, {0: [8, 9], 2: [10]})
    assert ids == [5, 6, 7, 8, 9, 10] and parents == [-1, 0, 1, -1, -1, 1] and dists is None
    check_parents(parents, len(ids))
    assert main_chain_len(parents, len(ids)) == 3 and main_chain_len(None, 3) == 3
    q = [SparseDist((5, 1), (0.6, 0.4))] * 3
    ids, parents, dists = build_tree([5, 6, 7], q, {1: [11]})
    assert dists is not None and dists[3] == SparseDist((11,), (1.0,))        # one-hot, tried after the sampled one
    assert build_tree([5, 6], None, {}) == ([5, 6], None, None)                # no alternatives: a plain chain
    ids, parents, _ = build_tree([1, 2], None, {0: [3, 4, 5], 1: [6]}, max_nodes=4)
    assert ids == [1, 2, 3, 4] and parents == [-1, 0, -1, -1]                  # earliest positions first


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def draft():
    running = await start_draft("tiny-draft")
    channel = grpc.aio.insecure_channel(running.addr)
    yield running, draft_pb2_grpc.DraftStub(channel)
    await channel.close()
    await running.stop()


async def propose(stub: draft_pb2_grpc.DraftStub, width: int, confidence: float = 0.0) -> draft_pb2.ProposeResponse:
    return await stub.Propose(draft_pb2.ProposeRequest(
        session_id=f"tree-{next(_ids)}", owner_token="t", context_len=len(CONTEXT), new_token_ids=CONTEXT,
        num_draft_tokens=4, tree_width=width, tree_confidence=confidence))


async def test_draft_service_returns_alternatives_at_low_confidence_positions(draft) -> None:
    _, stub = draft
    chain = await propose(stub, 0)
    assert not chain.alternatives
    tree = await propose(stub, 2, confidence=1.0)                # every position is below 100% confidence
    assert list(tree.draft_token_ids) == list(chain.draft_token_ids)           # alternatives never change the chain
    assert [a.position for a in tree.alternatives] == [0, 1, 2, 3]
    for alt in tree.alternatives:
        assert len(alt.token_ids) == 2 and tree.draft_token_ids[alt.position] not in alt.token_ids
        assert list(alt.probs) == sorted(alt.probs, reverse=True)
    confident = await propose(stub, 2, confidence=1e-9)         # nothing is below ~0 confidence
    assert not confident.alternatives
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await propose(stub, 99)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_model_drafter_sends_a_tree_and_prefetches_its_main_chain(draft) -> None:
    _, stub = draft
    drafter = ModelDrafter(stub, f"tree-{next(_ids)}", SamplingParams(), timeout_s=30.0, tree_width=2)
    block = await drafter.propose(CONTEXT, 4)
    assert block.parents is not None and len(block.token_ids) > 4           # tiny-draft is never 80% sure
    check_parents(block.parents, len(block.token_ids))
    chain = block.token_ids[:4]
    assert main_chain_len(block.parents, len(block.token_ids)) == 4
    drafter.prefetch(CONTEXT, block, 4)
    assert drafter.prefetching
    guess = (await drafter._prefetch.task).draft_token_ids[0]               # the draft's own next token
    nxt = await drafter.propose(CONTEXT + chain + [guess], 4)
    assert drafter.num_prefetch_hits == 1 and nxt.token_ids[:4] and nxt.parents is not None
    await drafter.close()


async def fresh_chain(stub: draft_pb2_grpc.DraftStub, context: list[int], k: int) -> list[int]:
    drafter = ModelDrafter(stub, f"tree-{next(_ids)}", SamplingParams(), timeout_s=30.0)
    try:
        return (await drafter.propose(context, k)).token_ids
    finally:
        await drafter.close()


async def test_branch_prefetch_drafts_the_continuation_after_the_likeliest_alternative(draft) -> None:
    """Overlap: while a tree is verified, the block after its likeliest alternative is drafted on a branch
    session; when the target takes that alternative (and the branch's guess of the next token is right), the next
    round is served from it, equal to what a fresh session drafts there."""
    _, stub = draft
    drafter = ModelDrafter(stub, f"tree-{next(_ids)}", SamplingParams(), timeout_s=30.0, tree_width=2,
                           branch_prefetch=True)
    block = await drafter.propose(CONTEXT, 4)
    assert block.likely_branch is not None and block.parents is not None
    position, token = block.likely_branch
    assert any(block.token_ids[i] == token and block.parents[i] == position - 1
               for i in range(4, len(block.token_ids)))                  # it is a sibling of chain node `position`
    drafter.prefetch(CONTEXT, block, 4)
    taken = CONTEXT + block.token_ids[:position] + [token]                 # rejected at `position`, alternative taken
    verified = taken + await fresh_chain(stub, taken, 1)
    nxt = await drafter.propose(verified, 4)
    assert drafter.num_branch_hits == 1 and drafter.num_prefetch_hits == 0
    assert nxt.token_ids == await fresh_chain(stub, verified, 4)
    after = await drafter.propose(verified + nxt.token_ids[:2] + [1], 4)   # the main session catches up
    assert after.token_ids[:4] == await fresh_chain(stub, verified + nxt.token_ids[:2] + [1], 4)
    await drafter.close()


PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return", "1, 2, 3, 4,", "Once upon a time, in a city"]


async def run_prompts(addr: str, tokenizer, max_new: int) -> tuple[int, int, int]:
    """Generates every prompt, checks it against target-only greedy; (rounds, accepted, most nodes in a round)."""
    rounds = accepted = most = 0
    for prompt in PROMPTS:
        request = client.make_request(prompt, max_new_tokens=max_new, num_draft_tokens=4, ignore_eos=True)
        responses = [r async for r in client.stream(addr, request, timeout_s=120)]
        assert [t for r in responses for t in r.token_ids] == reference_greedy(tokenizer(prompt)["input_ids"], max_new)
        rounds += sum(r.round.round > 0 for r in responses)
        accepted += sum(r.round.num_accepted for r in responses)
        most = max([most] + [r.round.num_drafted for r in responses])
    return rounds, accepted, most


@pytest.mark.parametrize(("draft_model", "adaptive"), [("tiny-draft", False), ("tiny-draft-unrelated", False),
                                                       ("tiny-draft", True)])
async def test_tree_drafts_give_exactly_the_target_greedy_output(draft_model: str, adaptive: bool) -> None:
    """adaptive: the draft-length controller prices the tree width each round (DraftLengthController.tree_width)."""
    verifier = await start_verifier()
    draft_service = await start_draft(draft_model)
    gateway = await start_gateway(verifier.addr, draft_service.addr, draft_tree_width=2,
                                  adaptive_draft_length=adaptive)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    try:
        rounds, _, most = await run_prompts(gateway.addr, tokenizer, 20)
        outcomes = gateway.server.stats["round_outcomes"]()
        assert 0 < outcomes["rounds"] <= rounds                            # rounds with a model draft
        assert outcomes["rounds"] == sum(outcomes[k] for k in ("all_accepted", "rejected_alt_hit",
                                                               "rejected_alt_miss", "rejected_no_alt"))
        assert most > 4                                                     # trees (k = 4 + alternatives) verified
        sampled = client.make_request(PROMPTS[0], max_new_tokens=20, num_draft_tokens=4, ignore_eos=True,
                                      temperature=0.8, seed=3)
        responses = [r async for r in client.stream(gateway.addr, sampled, timeout_s=120)]
        assert sum(len(r.token_ids) for r in responses) == 20                # sampled trees (q + one-hot) verify
        assert max(r.round.num_drafted for r in responses) > 4
    finally:
        for running in (gateway, draft_service, verifier):
            await running.stop()


async def test_trees_accept_what_chains_miss_with_an_unrelated_draft() -> None:
    """tiny-draft-unrelated's chains are never accepted on these prompts; with 8 alternatives per uncertain
    position the target's choice is sometimes among them (measured: 4 of ~150 rounds), and output stays exact.
    The verifier does not decode ahead here: its rounds would carry several target tokens each, leaving too few
    rounds for those rare hits."""
    verifier = await start_verifier(decode_ahead_tokens=0)
    draft_service = await start_draft("tiny-draft-unrelated")
    chains = await start_gateway(verifier.addr, draft_service.addr)
    trees = await start_gateway(verifier.addr, draft_service.addr, draft_tree_width=8)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    try:
        _, chain_accepted, _ = await run_prompts(chains.addr, tokenizer, 40)
        _, tree_accepted, _ = await run_prompts(trees.addr, tokenizer, 40)
        assert tree_accepted > chain_accepted
        assert trees.server.stats["round_outcomes"]()["rejected_alt_hit"] > 0
        assert chains.server.stats["round_outcomes"]()["rejected_alt_hit"] == 0
    finally:
        for running in (trees, chains, draft_service, verifier):
            await running.stop()


def test_round_outcomes_classify_each_ending() -> None:
    tree = Draft([5, 6, 7, 8], None, common_pb2.DRAFT_SOURCE_MODEL, [-1, 0, 1, 0])    # node 3: sibling of node 1
    assert classify(tree, 3, [0, 1, 2]) == "all_accepted"
    assert classify(tree, 2, [0, 3]) == "rejected_alt_hit"
    assert classify(tree, 1, [0]) == "rejected_alt_miss"                  # position 1 had an alternative
    assert classify(tree, 0, []) == "rejected_no_alt"
    chain = Draft([5, 6], None, common_pb2.DRAFT_SOURCE_MODEL)
    assert classify(chain, 2, []) == "all_accepted" and classify(chain, 1, []) == "rejected_no_alt"
    outcomes = RoundOutcomes()
    outcomes.observe(tree, 2, [0, 3])
    outcomes.observe_bonus(True)
    outcomes.observe(NO_DRAFT, 0, [])
    assert outcomes.snapshot() == {"rounds": 1, "all_accepted": 0, "bonus_guessed": 1, "bonus_missed": 0,
                                   "rejected_alt_hit": 1, "rejected_alt_miss": 0, "rejected_no_alt": 0,
                                   "branch_continuation_ready": 0}


def test_sampled_tree_with_one_hot_alternatives_after_the_sampled_child_is_exact() -> None:
    """The gateway's sampled trees: d ~ q, then the draft's next likeliest tokens (which depend on d) as one-hot
    siblings after it. Under recursive rejection sampling the first emitted token is distributed exactly as p."""
    p = torch.tensor([0.05, 0.30, 0.25, 0.10, 0.20, 0.10], dtype=torch.float64)
    q = torch.tensor([0.40, 0.05, 0.05, 0.30, 0.15, 0.05], dtype=torch.float64)
    q_sparse = SparseDist(tuple(range(6)), tuple(q.tolist()))
    generator = torch.Generator().manual_seed(14)
    counts = torch.zeros(6, dtype=torch.float64)
    for _ in range(6000):
        drafted = int(torch.multinomial(q, 1, generator=generator))
        alternatives = [int(t) for t in torch.argsort(q, descending=True) if int(t) != drafted][:2]
        ids, parents, dists = build_tree([drafted], [q_sparse], {0: alternatives})
        assert parents == [-1, -1, -1] and dists is not None
        rows = torch.stack([p] + [torch.full((6,), 1 / 6, dtype=torch.float64)] * len(ids))
        path, final = tree_rejection_sample(rows, ids, parents, dists, generator)
        counts[ids[path[0]] if path else final] += 1
    pvalue, tv = fit(counts, p)
    assert pvalue > MIN_PVALUE and tv < 0.03
