"""Invariant 1 through the full gRPC stack: greedy output == target-only greedy output, token for token."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from protos.specmesh.v1 import common_pb2, generate_pb2_grpc
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from tests.stack import reference_greedy, start_draft, start_gateway, start_verifier

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    return",
    "سلام، امروز هوا چطور است؟",
    "Speculative decoding splits work between a small draft model and",
    "a",
    "Once upon a time, in a city on a high valley, there lived an engineer who wrote a paged key value cache",
    "1, 2, 3, 4,",
    "import torch\nimport grpc\n",
]
MAX_NEW = 24


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack():
    verifier = await start_verifier(decode_ahead_tokens=8)          # the service default: exact with it on
    same = await start_draft("tiny-draft")
    unrelated = await start_draft("tiny-draft-unrelated")
    gw_same = await start_gateway(verifier.addr, same.addr)
    gw_unrelated = await start_gateway(verifier.addr, unrelated.addr)
    gw_dead_draft = await start_gateway(verifier.addr, "127.0.0.1:1")   # nothing listens there
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    no_ahead = await start_draft("tiny-draft", draft_ahead=False)
    gw_no_ahead = await start_gateway(verifier.addr, no_ahead.addr)
    gw_adaptive = await start_gateway(verifier.addr, unrelated.addr, adaptive_draft_length=True)
    gw_no_prefetch = await start_gateway(verifier.addr, same.addr, draft_prefetch=False)
    yield {"verifier": verifier, "same": gw_same, "unrelated": gw_unrelated, "dead": gw_dead_draft,
           "no_ahead": gw_no_ahead, "adaptive": gw_adaptive, "no_prefetch": gw_no_prefetch, "tokenizer": tokenizer,
           "same_draft": same}
    for running in (gw_same, gw_unrelated, gw_dead_draft, gw_no_ahead, gw_adaptive, gw_no_prefetch, same, unrelated,
                    no_ahead, verifier):
        await running.stop()


async def generate(addr: str, prompt: str, **kwargs):
    responses = [r async for r in client.stream(addr, client.make_request(prompt, **kwargs), timeout_s=120)]
    token_ids = [t for r in responses for t in r.token_ids]
    return token_ids, "".join(r.text for r in responses), responses


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer(prompt)["input_ids"]


async def wait_blocks_free(verifier, timeout_s: float = 10.0) -> None:
    engine = verifier.engine
    for _ in range(int(timeout_s / 0.05)):
        if engine.block_manager.num_used_blocks == 0 and not engine.sessions:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{engine.block_manager.num_used_blocks} KV blocks still used, sessions {engine.sessions}")


@pytest.mark.parametrize("draft", ["same", "unrelated", "no_ahead", "no_prefetch"])
@pytest.mark.parametrize("k", range(1, 9))
async def test_greedy_equals_target_only(stack, draft: str, k: int) -> None:
    tok = stack["tokenizer"]
    num_drafted = num_accepted = 0
    for prompt in PROMPTS[:4]:
        expected = reference_greedy(prompt_ids(tok, prompt), MAX_NEW)
        ids, text, responses = await generate(stack[draft].addr, prompt, max_new_tokens=MAX_NEW,
                                              num_draft_tokens=k, ignore_eos=True)
        assert ids == expected, f"k={k} draft={draft} prompt={prompt!r}"
        assert text == tok.decode(expected, skip_special_tokens=True)
        usage = responses[-1].usage
        assert usage.completion_tokens == MAX_NEW
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        num_drafted += usage.num_drafted_tokens
        num_accepted += usage.num_accepted_tokens
    assert num_drafted > 0
    prefetch = stack[draft].server.stats["drafting"]()
    if draft == "same":
        assert stack["same_draft"].engine.num_ahead_hits > 0   # drafted-ahead blocks were served
        assert prefetch["prefetch_hits"] > 0                   # ... and some rounds never waited on the draft link
    if draft == "no_prefetch":
        assert prefetch["prefetch_sent"] == 0
    if draft in ("same", "no_ahead", "no_prefetch"):
        assert num_accepted == num_drafted          # identical draft: everything accepted
    else:
        assert num_accepted / num_drafted < 0.3     # unrelated draft: nearly nothing accepted
    await wait_blocks_free(stack["verifier"])


async def test_target_only_and_dead_draft_equal_reference(stack, monkeypatch) -> None:
    tok = stack["tokenizer"]
    engine, speculative = stack["verifier"].engine, []
    start = engine.start_session

    def recording_start(*args, **kwargs):          # what the gateway told the verifier at each session's start
        speculative.append(args[5] if len(args) > 5 else kwargs.get("speculative"))
        return start(*args, **kwargs)

    monkeypatch.setattr(engine, "start_session", recording_start)
    for prompt in PROMPTS[4:]:
        expected = reference_greedy(prompt_ids(tok, prompt), MAX_NEW)
        ids, _, _ = await generate(stack["same"].addr, prompt, max_new_tokens=MAX_NEW, num_draft_tokens=0,
                                   ignore_eos=True)
        assert ids == expected
        ids, _, responses = await generate(stack["dead"].addr, prompt, max_new_tokens=MAX_NEW, num_draft_tokens=4,
                                           ignore_eos=True)
        assert ids == expected                       # draft service down: target-only fallback, same output
        assert responses[-1].usage.num_drafted_tokens == 0
    # StartSessionRequest.speculative: the drafting request says so (its verifier may guess in undrafted rounds)
    assert speculative == [False, True] * len(PROMPTS[4:])


async def test_adaptive_draft_length_stays_exact_and_backs_off(stack) -> None:
    """With an unrelated draft (acceptance ~0) the controller shortens drafts; output is unchanged."""
    tok = stack["tokenizer"]
    prompt = PROMPTS[3]
    expected = reference_greedy(prompt_ids(tok, prompt), 64)
    ids, _, responses = await generate(stack["adaptive"].addr, prompt, max_new_tokens=64, num_draft_tokens=8,
                                       ignore_eos=True)
    assert ids == expected
    drafted = [r.round.num_drafted for r in responses if r.round.round > 0]
    assert drafted[0] == 8 and sum(drafted[-5:]) < 5 * 8


async def test_concurrent_sessions_share_the_verifier(stack) -> None:
    """8 sessions of different lengths batched together: each output still equals its own target-only run."""
    tok = stack["tokenizer"]
    lengths = [8, 24, 16, 32, 12, 20, 28, 10]
    expected = [reference_greedy(prompt_ids(tok, p), n) for p, n in zip(PROMPTS, lengths, strict=True)]
    results = await asyncio.gather(*[
        generate(stack["same" if i % 2 else "unrelated"].addr, p, max_new_tokens=n, num_draft_tokens=1 + i % 5,
                 ignore_eos=True) for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))])
    assert [ids for ids, _, _ in results] == expected
    await wait_blocks_free(stack["verifier"])


async def test_eos_stops_generation(stack) -> None:
    tok = stack["tokenizer"]
    prompt = PROMPTS[1]
    full = reference_greedy(prompt_ids(tok, prompt), 64)
    ids, _, responses = await generate(stack["same"].addr, prompt, max_new_tokens=64, num_draft_tokens=3)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    if eos in full:
        assert ids == full[: full.index(eos)]
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    else:
        assert ids == full
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_stop_string_is_not_leaked(stack) -> None:
    prompt = PROMPTS[3]
    _, full_text, _ = await generate(stack["same"].addr, prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    assert len(stop) == 3
    _, text, responses = await generate(stack["same"].addr, prompt, max_new_tokens=MAX_NEW, ignore_eos=True,
                                        stop=[stop], num_draft_tokens=4)
    assert text == full_text[: full_text.index(stop)]
    assert stop not in text
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    await wait_blocks_free(stack["verifier"])


async def test_persian_prompt_streams_valid_utf8(stack) -> None:
    tok = stack["tokenizer"]
    ids, text, responses = await generate(stack["same"].addr, "سلام، امروز هوا چطور است؟ لطفاً کوتاه جواب بده.",
                                          max_new_tokens=40, ignore_eos=True, num_draft_tokens=5)
    assert text == tok.decode(ids, skip_special_tokens=True)
    emitted = ""
    for r in responses:
        emitted += r.text
        r.text.encode("utf-8")                              # every delta is a complete, encodable string
        assert text.startswith(emitted)                     # nothing streamed is ever taken back


async def test_complete_equals_stream(stack) -> None:
    ids, text, _ = await generate(stack["same"].addr, PROMPTS[0], max_new_tokens=MAX_NEW, ignore_eos=True)
    async with grpc.aio.insecure_channel(stack["same"].addr) as channel:
        reply = await generate_pb2_grpc.GenerationStub(channel).Complete(
            client.make_request(PROMPTS[0], max_new_tokens=MAX_NEW, ignore_eos=True))
    assert list(reply.token_ids) == ids and reply.text == text
    assert reply.usage.completion_tokens == MAX_NEW


async def test_client_cancel_releases_every_block(stack) -> None:
    verifier = stack["verifier"]
    request = client.make_request(PROMPTS[5], max_new_tokens=400, ignore_eos=True, num_draft_tokens=2)
    async with grpc.aio.insecure_channel(stack["same"].addr) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(request)
        async for _ in call:
            assert verifier.engine.block_manager.num_used_blocks > 0
            break
        call.cancel()
    await wait_blocks_free(verifier)


async def test_sampling_is_reproducible_with_a_seed(stack) -> None:
    kwargs = dict(max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1234,
                  num_draft_tokens=4)
    a, _, ra = await generate(stack["same"].addr, PROMPTS[0], **kwargs)
    b, _, _ = await generate(stack["same"].addr, PROMPTS[0], **kwargs)
    assert a == b and len(a) == MAX_NEW
    assert ra[-1].usage.num_drafted_tokens > 0
