"""Overlapped speculation (GatewayConfig.overlap): the next round's draft is asked for as soon as the verdict exists.
Greedy output stays exactly the target's, with every k, prefetch on/off, an unrelated draft and the draft service
down; a request that stops early releases its draft sessions (the early draft is cancelled, the branch session
ended)."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from specmesh.models import resolve_model_dir
from specmesh.ops import client
from tests.stack import reference_greedy, start_draft, start_gateway, start_verifier

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return", "1, 2, 3, 4,"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack():
    verifier = await start_verifier()
    same = await start_draft("tiny-draft")
    unrelated = await start_draft("tiny-draft-unrelated")
    gateways = {
        "same": await start_gateway(verifier.addr, same.addr, overlap=True),
        "same_no_prefetch": await start_gateway(verifier.addr, same.addr, overlap=True, draft_prefetch=False),
        "unrelated": await start_gateway(verifier.addr, unrelated.addr, overlap=True, adaptive_draft_length=True),
        "unrelated_tree": await start_gateway(verifier.addr, unrelated.addr, overlap=True, draft_tree_width=2),
        "dead": await start_gateway(verifier.addr, "127.0.0.1:1", overlap=True),
    }
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    yield {"gateways": gateways, "tokenizer": tokenizer, "same_draft": same, "unrelated_draft": unrelated}
    for running in (*gateways.values(), same, unrelated, verifier):
        await running.stop()


async def generate(addr: str, prompt: str, **kwargs) -> list[int]:
    responses = [r async for r in client.stream(addr, client.make_request(prompt, **kwargs), timeout_s=120)]
    return [t for r in responses for t in r.token_ids]


@pytest.mark.parametrize("gateway", ["same", "same_no_prefetch", "unrelated", "unrelated_tree", "dead"])
@pytest.mark.parametrize("k", [1, 4, 8])
async def test_overlap_keeps_greedy_output(stack, gateway: str, k: int) -> None:
    addr, tokenizer = stack["gateways"][gateway].addr, stack["tokenizer"]
    for prompt in PROMPTS:
        got = await generate(addr, prompt, max_new_tokens=20, num_draft_tokens=k, ignore_eos=True)
        assert got == reference_greedy(tokenizer(prompt)["input_ids"], 20)


@pytest.mark.parametrize(("gateway", "draft"), [("same", "same_draft"), ("unrelated_tree", "unrelated_draft")])
async def test_an_early_stop_releases_the_draft_sessions(stack, gateway: str, draft: str) -> None:
    """unrelated_tree also opens a branch session (the continuation after the likeliest alternative)."""
    got = await generate(stack["gateways"][gateway].addr, PROMPTS[0], max_new_tokens=5, num_draft_tokens=4,
                         ignore_eos=True)
    assert len(got) == 5
    engine = stack[draft].engine
    for _ in range(100):                              # cleanup runs as its own task after the stream ends
        if not engine.sessions:
            break
        await asyncio.sleep(0.05)
    assert not engine.sessions
