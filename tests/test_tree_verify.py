"""Token-tree verification on a real verifier server (tiny models), driven by hand through StartSession / Verify.

- A tree holding the target's greedy continuation on one branch (among decoys) accepts exactly that branch.
- Rounds of random trees reproduce target-only greedy output token for token (float32: plain transformers; int8:
  the same verifier with no drafts), so the accepted path's KV really is where decoding continues from.
- Every KV block is free after EndSession; malformed trees are INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import grpc
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from protos.specmesh.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specmesh.models import resolve_model_dir
from specmesh.spec.tree import depths
from tests.stack import reference_greedy, slow_forwards, start_verifier
from tests.test_e2e_greedy import PROMPTS, wait_blocks_free

VOCAB_DECOY = 7


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=["float32", "int8", "int4", "int4-ahead"])
async def verifier(request: pytest.FixtureRequest):
    """`-ahead`: the verifier decodes greedy sessions ahead while they wait (the service default), so verifies
    first meet those tokens (verifier_service/ahead.py); the others check tree verification alone."""
    dtype, _, ahead = request.param.partition("-")
    running = await start_verifier(dtype=dtype, block_size=4, max_model_len=256,
                                   decode_ahead_tokens=8 if ahead else 0)
    async with grpc.aio.insecure_channel(running.addr) as channel:
        yield running, verifier_pb2_grpc.VerifierStub(channel), dtype
    await running.stop()


class Session:
    def __init__(self, stub: verifier_pb2_grpc.VerifierStub, prompt_ids: list[int],
                 sampling: common_pb2.SamplingParams | None = None) -> None:
        self.stub, self.prompt_ids, self.sampling = stub, prompt_ids, sampling
        self.session_id = uuid.uuid4().hex
        self.output: list[int] = []
        self.owner_token = ""

    async def start(self) -> None:
        reply = await self.stub.StartSession(verifier_pb2.StartSessionRequest(
            session_id=self.session_id, prompt_token_ids=self.prompt_ids, max_new_tokens=64, sampling=self.sampling))
        self.owner_token = reply.owner_token
        self.output.append(reply.first_token_id)

    async def verify(self, token_ids: list[int], parents: list[int] | None = None,
                     dists: list[common_pb2.SparseDist] | None = None) -> verifier_pb2.VerifyResponse:
        reply = await self.stub.Verify(verifier_pb2.VerifyRequest(
            session_id=self.session_id, owner_token=self.owner_token, draft_token_ids=token_ids,
            draft_parents=parents or [], draft_dists=dists or []))
        self.output.extend(reply.token_ids)
        return reply

    async def end(self) -> None:
        await self.stub.EndSession(common_pb2.EndSessionRequest(session_id=self.session_id,
                                                                 owner_token=self.owner_token))


async def expected_output(stub: verifier_pb2_grpc.VerifierStub, dtype: str, prompt_ids: list[int],
                          n: int) -> list[int]:
    """Target-only greedy: transformers for float32, the same verifier without drafts for int8 / int4."""
    if dtype == "float32":
        return reference_greedy(prompt_ids, n)
    session = Session(stub, prompt_ids)
    await session.start()
    while len(session.output) < n:
        await session.verify([])
    await session.end()
    return session.output[:n]


def decoy(token: int) -> int:
    return (token + VOCAB_DECOY) % 500 + 3


async def test_tree_with_the_greedy_branch_accepts_exactly_it(verifier, tokenizer) -> None:
    running, stub, dtype = verifier
    prompt_ids = tokenizer(PROMPTS[0])["input_ids"]
    expected = await expected_output(stub, dtype, prompt_ids, 8)
    session = Session(stub, prompt_ids)
    await session.start()
    assert session.output == expected[:1]
    e1, e2, e3 = expected[1:4]
    #         root
    #       /   |    \
    #   d(e1)   e1    d(e1)
    #     |    /  \
    #    e2  d(e2) e2
    #               \
    #                e3
    token_ids = [decoy(e1), e2, e1, decoy(e2), e2, e3, decoy(e1)]
    parents = [-1, 0, -1, 2, 2, 4, -1]
    reply = await session.verify(token_ids, parents)
    assert list(reply.accepted_node_indices) == [2, 4, 5] and reply.num_accepted == 3
    assert list(reply.token_ids[:4]) == expected[1:5]        # (and any further tokens decoded ahead)
    if len(session.output) == 5:
        await session.verify([expected[5], decoy(expected[6])], [-1, -1])    # decoding goes on from the moved KV
    while len(session.output) < 8:
        await session.verify([])
    assert session.output[:8] == expected[:8]
    await session.end()
    await wait_blocks_free(running)


async def tree_rounds(stub: verifier_pb2_grpc.VerifierStub, prompt_ids: list[int], expected: list[int], n: int,
                      rng: random.Random, chains: bool = False) -> tuple[list[int], int, bool]:
    """Random trees (or chains, empty parents) built around `expected` until n tokens: (output, drafts accepted,
    whether some forward also ran other sessions' tokens)."""
    session = Session(stub, prompt_ids)
    await session.start()
    accepted_total, shared = 0, False
    while len(session.output) < n:
        token_ids, parents = random_tree(rng, expected[len(session.output):])
        if chains:
            token_ids, parents = token_ids[:3], None
        reply = await session.verify(token_ids, parents)
        accepted_total += reply.num_accepted
        shared |= reply.num_batch_tokens > len(token_ids) + 1
        assert [token_ids[i] for i in reply.accepted_node_indices] == list(reply.token_ids[:reply.num_accepted])
    await session.end()
    return session.output[:n], accepted_total, shared


@pytest.mark.parametrize("seed", range(3))
async def test_random_tree_rounds_reproduce_target_only_greedy(verifier, tokenizer, seed: int) -> None:
    running, stub, dtype = verifier
    prompt_ids = tokenizer(PROMPTS[seed + 1])["input_ids"]
    expected = await expected_output(stub, dtype, prompt_ids, 40 + 16)
    output, accepted_total, _ = await tree_rounds(stub, prompt_ids, expected, 40, random.Random(seed))
    assert output == expected[:40]
    assert accepted_total > 0
    await wait_blocks_free(running)


async def test_concurrent_trees_and_chains_share_forwards_exactly(verifier, tokenizer, monkeypatch) -> None:
    """Sessions verifying trees and chains at the same time (one batched forward) each stay exact."""
    running, stub, dtype = verifier
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:4]]
    expected = [await expected_output(stub, dtype, ids, 40) for ids in prompts]
    slow_forwards(monkeypatch, running.engine.runner, 0.02)      # the sessions' verifies queue up and share forwards
    results = await asyncio.gather(*[tree_rounds(stub, ids, exp, 24, random.Random(i), chains=i % 2 == 1)
                                     for i, (ids, exp) in enumerate(zip(prompts, expected, strict=True))])
    assert [out for out, _, _ in results] == [exp[:24] for exp in expected]
    assert any(shared for _, _, shared in results)
    await wait_blocks_free(running)


def random_tree(rng: random.Random, continuation: list[int]) -> tuple[list[int], list[int]]:
    """Up to 12 nodes under random parents; a node under a correct path is correct with probability 0.5."""
    parents: list[int] = []
    token_ids: list[int] = []
    correct: list[bool] = []
    for i in range(rng.randint(1, 12)):
        parent = rng.randint(-1, i - 1)
        depth = 0 if parent == -1 else depths(parents + [parent])[-1]
        on_path = (parent == -1 or correct[parent]) and depth < len(continuation)
        right = on_path and rng.random() < 0.5
        token_ids.append(continuation[depth] if right else rng.randint(3, 500))
        parents.append(parent)
        correct.append(right or (on_path and token_ids[-1] == continuation[depth]))
    return token_ids, parents


async def test_sampled_tree_rounds_accept_a_root_path(verifier, tokenizer) -> None:
    """Sampling: the accepted nodes form a path from the root, tokens and indices agree, and a seed replays."""
    running, stub, _ = verifier
    rng = random.Random(5)
    outputs = []
    for _ in range(2):
        session = Session(stub, tokenizer(PROMPTS[2])["input_ids"], common_pb2.SamplingParams(temperature=1.0, seed=3))
        await session.start()
        rng.seed(5)
        for _ in range(6):
            token_ids, parents = random_tree(rng, [])
            q = [common_pb2.SparseDist(token_ids=[t, decoy(t)], probs=[0.6, 0.4]) for t in token_ids]
            reply = await session.verify(token_ids, parents, q)
            path = list(reply.accepted_node_indices)
            assert all(parents[b] == a for a, b in zip([-1, *path], path, strict=False))
            # the path's tokens, then the target's (and, decoding ahead, any further tokens it decoded meanwhile)
            assert [token_ids[i] for i in path] == list(reply.token_ids[:len(path)])
            assert len(reply.token_ids) == len(path) + 1 or running.engine.ahead.max_tokens > 0
        await session.end()
        outputs.append(session.output)
    # a seeded session's tokens depend on the seed alone, not on the drafts (nor on how many were decoded ahead)
    num_common = min(map(len, outputs))
    assert num_common >= 7 and outputs[0][:num_common] == outputs[1][:num_common]
    await wait_blocks_free(running)


@pytest.mark.parametrize("parents", [[0, -1], [-1, 1], [-2, 0], [-1], [-1, 0, 1]])
async def test_malformed_parents_are_invalid_argument(verifier, tokenizer, parents: list[int]) -> None:
    running, stub, _ = verifier
    session = Session(stub, tokenizer(PROMPTS[0])["input_ids"])
    await session.start()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await session.verify([5, 6], parents)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "draft_parents" in info.value.details()
    reply = await session.verify([5, 6], [-1, -1])                    # the session is still usable
    assert reply.num_accepted <= 1
    await session.end()
    await wait_blocks_free(running)
