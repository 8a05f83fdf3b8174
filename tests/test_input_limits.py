"""Every input capped from one table (specmesh.config.InputLimits): a test per cap, on the gRPC API, the HTTP API
(/v1/tokenize in both forms included) and the internal verifier / draft RPCs. Each refusal is INVALID_ARGUMENT /
400 naming the field and the cap (a body or message over max_body_bytes: 413 / RESOURCE_EXHAUSTED)."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import grpc
import pytest
import pytest_asyncio

from draft_service.servicer import DraftServicer
from gateway.openai_http import ServedModel, start_openai_http
from protos.specmesh.v1 import common_pb2, draft_pb2, generate_pb2, generate_pb2_grpc, verifier_pb2
from specmesh.config import GatewayConfig, InputLimits, load_config
from specmesh.engine.errors import EngineError
from specmesh.ops import client
from specmesh.rpc.leases import SessionLeases
from tests.stack import start_gateway, start_verifier
from verifier_service.servicer import VerifierServicer
from verifier_service.tenant_share import TenantShare

LIMITS = InputLimits(max_body_bytes=8192, max_prompt_chars=100, max_messages=3, max_stop_strings=2,
                     max_stop_string_len=5, max_new_tokens_limit=20, max_request_id_len=10, max_token_ids=50)


def test_limits_are_read_from_the_environment() -> None:
    env = {"SPECMESH_GATEWAY_MAX_PROMPT_CHARS": "1234", "SPECMESH_GATEWAY_MAX_BODY_BYTES": "99"}
    config = load_config(GatewayConfig, "gateway", [], env)
    assert config.limits.max_prompt_chars == 1234 and config.limits.max_body_bytes == 99
    assert load_config(GatewayConfig, "gateway", ["--max-messages", "7"], {}).limits.max_messages == 7


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway():
    verifier = await start_verifier()
    running = await start_gateway(verifier.addr, "", limits=LIMITS, default_max_new_tokens=8)
    http = await start_openai_http(ServedModel("tiny-target", 1024, 0), "127.0.0.1", 0, lambda: running.addr,
                                   tokenizer=_tokenizer(), limits=LIMITS)
    yield {"grpc": running.addr, "http": f"http://127.0.0.1:{http.port}"}
    await http.close()
    for server in (running, verifier):
        await server.stop()


def _tokenizer():
    from transformers import AutoTokenizer

    from specmesh.models import resolve_model_dir
    return AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))


async def _refusal(addr: str, request: generate_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(addr) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate_pb2_grpc.GenerationStub(channel).Complete(request, timeout=60)
    return info.value.code(), info.value.details() or ""


GRPC_CASES = {
    "max_prompt_chars": (dict(prompt="a" * 101), "prompt has 101 characters; the limit is 100"),
    "max_messages": (dict(messages=[generate_pb2.ChatMessage(role="user", content="hi")] * 4),
                     "messages has 4 messages; the limit is 3"),
    "max_prompt_chars (messages)": (dict(messages=[generate_pb2.ChatMessage(role="user", content="a" * 60)] * 2),
                                    "messages hold 120 characters; the limit is 100"),
    "max_stop_strings": (dict(prompt="hi", stop=["a", "b", "c"]), "stop has 3 strings; the limit is 2"),
    "max_stop_string_len": (dict(prompt="hi", stop=["abcdef"]), "stop[0] has 6 characters; the limit is 5"),
    "max_new_tokens_limit": (dict(prompt="hi", max_new_tokens=21), "max_new_tokens is 21; the limit is 20"),
    "max_request_id_len": (dict(prompt="hi", request_id="r" * 11), "request_id has 11 characters; the limit is 10"),
}


@pytest.mark.parametrize("cap", list(GRPC_CASES))
async def test_grpc_caps(gateway, cap: str) -> None:
    fields, message = GRPC_CASES[cap]
    code, details = await _refusal(gateway["grpc"], generate_pb2.GenerateRequest(**fields))
    name = cap.split(" ")[0].upper()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"{message} (SPECMESH_GATEWAY_{name})"


async def test_grpc_num_draft_tokens_cap(gateway) -> None:
    code, details = await _refusal(gateway["grpc"], client.make_request("hi", num_draft_tokens=17))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "num_draft_tokens must be <= 16, got 17"


async def test_grpc_message_over_the_body_cap(gateway) -> None:
    code, _ = await _refusal(gateway["grpc"], generate_pb2.GenerateRequest(prompt="a" * 9000))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED             # refused by gRPC before it is decoded


async def test_requests_within_the_caps_still_run(gateway) -> None:
    async with grpc.aio.insecure_channel(gateway["grpc"]) as channel:
        reply = await generate_pb2_grpc.GenerationStub(channel).Complete(
            client.make_request("a" * 90, max_new_tokens=20, ignore_eos=True, stop=["xxxxx", "y"]), timeout=60)
    assert len(reply.token_ids) == 20


HTTP_CASES = {
    "tokenize prompt": ("/v1/tokenize", {"prompt": "a" * 101}, "prompt", "prompt has 101 characters"),
    "tokenize messages count": ("/v1/tokenize", {"messages": [{"role": "user", "content": "x"}] * 4}, "messages",
                                "messages has 4 messages; the limit is 3"),
    "tokenize messages size": ("/v1/tokenize", {"messages": [{"role": "user", "content": "x" * 101}]}, "messages",
                               "messages hold 101 characters; the limit is 100"),
    "completion prompt": ("/v1/completions", {"prompt": "a" * 101}, "prompt", "prompt has 101 characters"),
    "completion stop": ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c"]}, "stop", "stop has 3 strings"),
    "chat messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 4}, "messages",
                      "messages has 4 messages"),
}


@pytest.mark.parametrize("case", list(HTTP_CASES))
async def test_http_caps(gateway, case: str) -> None:
    path, body, param, message = HTTP_CASES[case]
    async with aiohttp.ClientSession() as session, session.post(gateway["http"] + path, json=body) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["message"].startswith(message) and "SPECMESH_GATEWAY_MAX_" in error["message"]
    assert error["param"] == param and "\n" not in error["message"]


async def test_http_body_over_the_cap_is_413(gateway) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            gateway["http"] + "/v1/tokenize", data=b'{"prompt": "' + b"a" * 9000 + b'"}',
            headers={"Content-Type": "application/json"}) as response:
        assert response.status == 413
        error = (await response.json())["error"]
    assert "8192 bytes" in error["message"] and "SPECMESH_GATEWAY_MAX_BODY_BYTES" in error["message"]


async def test_tokenize_within_the_caps(gateway) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            gateway["http"] + "/v1/tokenize", json={"prompt": "a" * 100}) as response:
        assert response.status == 200 and (await response.json())["count"] > 0


NO_SHARE = TenantShare(1 << 30, 0)     # the servicers below have no engine (its session count sizes the share)


async def test_verifier_caps_the_prompt_token_ids() -> None:
    servicer = VerifierServicer(None, "m", 1000, (), SessionLeases(60.0), limits=LIMITS,    # type: ignore[arg-type]
                                share=NO_SHARE)
    request = verifier_pb2.StartSessionRequest(session_id="s", prompt_token_ids=[1] * 51)
    with pytest.raises(EngineError) as info:
        await servicer.StartSession(request, None)    # type: ignore[arg-type]
    assert info.value.code == "INVALID_ARGUMENT"
    assert str(info.value) == ("prompt_token_ids has 51 token ids; the limit is 50 "
                               "(SPECMESH_VERIFIER_MAX_TOKEN_IDS)")
    assert len(servicer.leases) == 0


async def test_verifier_caps_the_entries_of_draft_dists() -> None:
    servicer = VerifierServicer(None, "m", 1000, (), SessionLeases(60.0), limits=LIMITS,    # type: ignore[arg-type]
                                share=NO_SHARE)
    dists = [common_pb2.SparseDist(token_ids=list(range(30)), probs=[1.0] * 30)] * 2
    request = verifier_pb2.VerifyRequest(session_id="s", draft_token_ids=[1, 2], draft_dists=dists)
    with pytest.raises(EngineError) as info:
        await servicer.Verify(request, None)    # type: ignore[arg-type]
    assert str(info.value) == "draft_dists has 60 token ids; the limit is 50 (SPECMESH_VERIFIER_MAX_TOKEN_IDS)"


async def test_verifier_caps_the_draft_tokens() -> None:
    servicer = VerifierServicer(None, "m", 1000, (), SessionLeases(60.0), max_draft_tokens=4,  # type: ignore[arg-type]
                                share=NO_SHARE)
    with pytest.raises(EngineError) as info:
        await servicer.Verify(verifier_pb2.VerifyRequest(session_id="s", draft_token_ids=[1] * 5), None)
    assert info.value.code == "INVALID_ARGUMENT" and "the limit is max_draft_tokens = 4" in str(info.value)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(new_token_ids=[1] * 51, context_len=51), "new_token_ids has 51 token ids; the limit is 50 "
                                                   "(SPECMESH_DRAFT_MAX_TOKEN_IDS)"),
    (dict(new_token_ids=[1], context_len=1, num_draft_tokens=9), "num_draft_tokens must be <= 8, got 9"),
])
def test_draft_service_caps(fields: dict, message: str) -> None:
    servicer = DraftServicer(None, 1000, 8, 32, SessionLeases(60.0), LIMITS)   # type: ignore[arg-type]
    with pytest.raises(EngineError) as info:
        servicer._validate(draft_pb2.ProposeRequest(session_id="s", owner_token="t", **fields))
    assert info.value.code == "INVALID_ARGUMENT" and str(info.value) == message


class BlockingTokenizer:
    """Counts how many calls tokenize at once; each waits until released (it runs in a worker thread)."""

    chat_template = None

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = self.most = 0
        self.release = threading.Event()

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        self.release.wait(30)
        with self.lock:
            self.inside -= 1
        return {"input_ids": [1, 2, 3]}


async def test_tokenize_calls_wait_their_turn() -> None:
    tokenizer = BlockingTokenizer()
    http = await start_openai_http(ServedModel("m", 1024, 0), "127.0.0.1", 0, lambda: "unused",
                                   tokenizer=tokenizer, limits=InputLimits(max_concurrent_tokenize=2))
    url = f"http://127.0.0.1:{http.port}/v1/tokenize"
    try:
        async with aiohttp.ClientSession() as session:
            async def tokenize() -> int:
                async with session.post(url, json={"prompt": "hello"}) as response:
                    return (await response.json())["count"]

            calls = [asyncio.ensure_future(tokenize()) for _ in range(5)]
            while tokenizer.inside < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)                 # the other three are queued, not tokenizing
            assert tokenizer.inside == 2
            tokenizer.release.set()
            assert await asyncio.gather(*calls) == [3] * 5
        assert tokenizer.most == 2
    finally:
        tokenizer.release.set()
        await http.close()
