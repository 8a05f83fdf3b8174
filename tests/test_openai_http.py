"""The gateway's OpenAI-compatible HTTP API, driven with the official `openai` client: completions and chat
completions, streamed (SSE) and not, give the same greedy text as the gRPC API; errors map to HTTP statuses."""

from __future__ import annotations

import asyncio

import openai
import pytest
import pytest_asyncio

from gateway.openai_http import ServedModel, start_openai_http
from specmesh.ops import client
from tests.stack import start_draft, start_gateway, start_verifier

PROMPT = "The quick brown fox"
CHAT = [("system", "You are terse."), ("user", "Write a function that reverses a string.")]
GREEDY = {"temperature": 0, "max_tokens": 20, "extra_body": {"ignore_eos": True, "num_draft_tokens": 3}}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack():
    verifier = await start_verifier()
    draft = await start_draft()
    gw = await start_gateway(verifier.addr, draft.addr)
    http = await start_openai_http(ServedModel("tiny-target", 2048, 0), "127.0.0.1", 0, lambda: gw.addr)
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="unused", max_retries=0,
                             timeout=120)
    yield {"api": api, "gateway": gw, "verifier": verifier}
    await api.close()
    await http.close()
    for running in (gw, draft, verifier):
        await running.stop()


async def grpc_text(addr: str, prompt: str = "", messages=()) -> str:
    request = client.make_request(prompt, messages=messages, max_new_tokens=20, ignore_eos=True,
                                  num_draft_tokens=3)
    return "".join([r.text async for r in client.stream(addr, request, timeout_s=120)])


async def test_models_lists_the_target(stack) -> None:
    models = await stack["api"].models.list()
    assert [m.id for m in models.data] == ["tiny-target"]


async def test_completion_streamed_and_not_equals_grpc(stack) -> None:
    expected = await grpc_text(stack["gateway"].addr, PROMPT)
    api = stack["api"]
    whole = await api.completions.create(model="tiny-target", prompt=PROMPT, **GREEDY)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 20 and whole.id.startswith("cmpl-")
    stream = await api.completions.create(model="tiny-target", prompt=PROMPT, stream=True,
                                          stream_options={"include_usage": True}, **GREEDY)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len([c for c in chunks if c.choices]) > 1                     # really streamed, chunk by chunk
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


async def test_chat_completion_streamed_and_not_equals_grpc(stack) -> None:
    expected = await grpc_text(stack["gateway"].addr, messages=CHAT)
    messages = [{"role": r, "content": c} for r, c in CHAT]
    api = stack["api"]
    whole = await api.chat.completions.create(model="tiny-target", messages=messages, **GREEDY)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    stream = await api.chat.completions.create(model="tiny-target", messages=messages, stream=True, **GREEDY)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_errors_map_to_http_statuses(stack) -> None:
    api = stack["api"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await api.completions.create(model="gpt-4", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="temperature"):          # gRPC INVALID_ARGUMENT -> 400
        await api.completions.create(model="tiny-target", prompt=PROMPT, temperature=-1, stream=True)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        await api.chat.completions.create(model="tiny-target", messages=[{"role": "user", "content": "hi"}], n=2)


async def test_disconnected_stream_releases_kv_blocks(stack) -> None:
    engine = stack["verifier"].engine
    stream = await stack["api"].completions.create(model="tiny-target", prompt=PROMPT, stream=True,
                                                   temperature=0, max_tokens=1000, extra_body={"ignore_eos": True})
    async for _ in stream:
        assert engine.block_manager.num_used_blocks > 0
        break
    await stream.close()
    for _ in range(40):       # 2 s: well before the 1000 tokens would be done (about 6 s here)
        if engine.block_manager.num_used_blocks == 0 and not engine.sessions:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{engine.block_manager.num_used_blocks} KV blocks still held after the client left")
