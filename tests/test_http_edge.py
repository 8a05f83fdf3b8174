"""The HTTP API's edge: every bad input is a 4xx JSON error in OpenAI's shape naming the OpenAI field (never a
500, never text/plain), HTTP refusals are counted in the gateway's error metric, HTTP requests in its request and
token metrics, and /health /ping /version /metrics /v1/models /v1/tokenize answer; HTTPS with the gateway's
certificate when TLS is configured."""

from __future__ import annotations

import json
import logging
import ssl
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.test_utils import make_mocked_request
from prometheus_client.parser import text_string_to_metric_families

from gateway.http_edge import error_middleware, http_ssl_context
from gateway.openai_http import ServedModel, add_loopback_port, start_openai_http
from gateway.server import build_gateway_parts
from protos.specmesh.v1 import generate_pb2
from specmesh.config import GatewayConfig, TlsConfig
from specmesh.telemetry.metrics import GatewayMetrics
from tests.stack import start_verifier

MAKE_CERTS = Path(__file__).resolve().parent.parent / "deploy" / "make_certs.sh"
OK = {"model": "tiny-target", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny-target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def body(base: dict, **changes: object) -> bytes:
    return json.dumps({**base, **changes}).encode()


# (id, method, path, raw body, content type, status, error param or None, words the message must hold)
CASES = [
    ("max-tokens-huge", "POST", "/v1/completions", body(OK, max_tokens=10**12), None, 400, "max_tokens", "max_tokens"),
    ("max-tokens-zero", "POST", "/v1/completions", body(OK, max_tokens=0), None, 400, "max_tokens", "max_tokens"),
    ("max-tokens-over-limit", "POST", "/v1/completions", body(OK, max_tokens=100_000), None, 400, "max_tokens",
     "max_tokens is 100000; the limit is 4096"),
    ("chat-max-tokens-zero", "POST", "/v1/chat/completions", body(CHAT, max_tokens=0), None, 400, "max_tokens",
     "max_tokens"),
    ("max-tokens-float", "POST", "/v1/completions", body(OK, max_tokens=1e12), None, 400, "max_tokens", "int"),
    ("top-k-huge", "POST", "/v1/completions", body(OK, top_k=2**40), None, 400, "top_k", "top_k"),
    ("seed-huge", "POST", "/v1/completions", body(OK, seed=2**70), None, 400, "seed", "seed"),
    ("seed-negative", "POST", "/v1/completions", body(OK, seed=-1), None, 400, "seed", "seed"),
    ("temperature-huge", "POST", "/v1/completions", body(OK, temperature=1e39), None, 400, "temperature", "finite"),
    ("top-p-huge-int", "POST", "/v1/completions", body(OK, top_p=2**1100), None, 400, "top_p", "finite"),
    ("temperature-nan", "POST", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', None, 400, None, "JSON"),
    ("temperature-negative", "POST", "/v1/completions", body(OK, temperature=-1), None, 400, "temperature",
     "temperature must be >= 0"),
    ("num-draft-huge", "POST", "/v1/completions", body(OK, num_draft_tokens=2**33), None, 400, "num_draft_tokens",
     "num_draft_tokens"),
    ("prompt-surrogate", "POST", "/v1/completions", body(OK, prompt="ab\ud800"), None, 400, "prompt", "surrogate"),
    ("content-surrogate", "POST", "/v1/chat/completions",
     body(CHAT, messages=[{"role": "user", "content": "\ud800"}]), None, 400, "messages[0].content", "surrogate"),
    ("content-part-surrogate", "POST", "/v1/chat/completions",
     body(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]), None, 400,
     "messages[0].content", "surrogate"),
    ("stop-surrogate", "POST", "/v1/completions", body(OK, stop=["ok", "\ud800"]), None, 400, "stop", "surrogate"),
    ("model-surrogate", "POST", "/v1/completions", body(OK, model="\ud800"), None, 400, "model", "surrogate"),
    ("deeply-nested", "POST", "/v1/completions", b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", None,
     400, None, "nests"),
    ("bad-json", "POST", "/v1/completions", b'{"prompt": "x",', None, 400, None, "not valid JSON"),
    ("not-utf8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', None, 400, None, "UTF-8"),
    ("json-array", "POST", "/v1/completions", b"[1, 2]", None, 400, None, "JSON object"),
    ("prompt-int", "POST", "/v1/completions", body(OK, prompt=5), None, 400, "prompt", "prompt"),
    ("prompt-missing", "POST", "/v1/completions", body({"model": "tiny-target"}), None, 400, "prompt", "prompt"),
    ("temperature-string", "POST", "/v1/completions", body(OK, temperature="hot"), None, 400, "temperature",
     "temperature"),
    ("stream-string", "POST", "/v1/completions", body(OK, stream="yes"), None, 400, "stream", "stream"),
    ("messages-string", "POST", "/v1/chat/completions", body(CHAT, messages="hi"), None, 400, "messages",
     "messages"),
    ("role-list", "POST", "/v1/chat/completions", body(CHAT, messages=[{"role": ["user"], "content": "x"}]), None,
     400, "messages[0]", "role"),
    ("content-part-int", "POST", "/v1/chat/completions",
     body(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), None, 400,
     "messages[0].content", "content"),
    ("empty-prompt", "POST", "/v1/completions", body(OK, prompt=" "), None, 400, "prompt", "prompt must not be empty"),
    ("wrong-content-type", "POST", "/v1/completions", body(OK), "text/plain", 415, None, "application/json"),
    ("form-content-type", "POST", "/v1/completions", b"prompt=x", "application/x-www-form-urlencoded", 415, None,
     "application/json"),
    ("body-too-large", "POST", "/v1/completions", b'{"prompt": "' + b"a" * (30 * 2**20) + b'"}', None, 413, None,
     "larger than"),
    ("unknown-route", "GET", "/v1/nope", b"", None, 404, None, "Invalid URL"),
    ("unknown-route-post", "POST", "/v2/completions", body(OK), None, 404, None, "Invalid URL"),
    ("wrong-method", "GET", "/v1/completions", b"", None, 405, None, "not allowed"),
    ("wrong-method-models", "DELETE", "/v1/models", b"", None, 405, None, "not allowed"),
    ("unknown-model", "POST", "/v1/completions", body(OK, model="gpt-4"), None, 404, "model", "does not exist"),
    ("tokenize-surrogate", "POST", "/v1/tokenize", body({"prompt": "\ud800"}), None, 400, "prompt", "surrogate"),
    ("tokenize-bad-flag", "POST", "/v1/tokenize", body({"prompt": "x", "add_special_tokens": "no"}), None, 400,
     "add_special_tokens", "bool"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def edge():
    verifier = await start_verifier()
    config = GatewayConfig(port=0, verifier_addr=verifier.addr, draft_addr="", enable_cache=False,
                           enable_ngram=False, suffix_drafting=False, adaptive_draft_length=False)
    gateway = await build_gateway_parts(config, wait_for_verifier_s=30)
    port = await gateway.server.start("127.0.0.1", 0)
    http = await start_openai_http(ServedModel("tiny-target", 2048, 0), "127.0.0.1", 0, lambda: f"127.0.0.1:{port}",
                                   metrics=gateway.metrics, tokenizer=gateway.tokenizer)
    session = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{http.port}",
                                    timeout=aiohttp.ClientTimeout(total=120))
    yield {"session": session, "gateway": gateway, "http": http, "grpc_port": port, "verifier": verifier.addr}
    await session.close()
    await http.close()
    await gateway.server.stop(0)
    await verifier.stop()


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def scrape(session: aiohttp.ClientSession) -> str:
    async with session.get("/metrics") as response:
        assert response.status == 200 and response.content_type == "text/plain"
        return await response.text()


@pytest.mark.parametrize(("method", "path", "raw", "content_type", "status", "param", "words"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_bad_input_is_a_4xx_openai_json_error(edge, method, path, raw, content_type, status, param,
                                                    words) -> None:
    headers = {"Content-Type": content_type or "application/json"} if raw else {}
    async with edge["session"].request(method, path, data=raw, headers=headers) as response:
        assert response.status == status, await response.text()
        assert response.content_type == "application/json"
        error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]
    assert "max_new_tokens" not in error["message"]          # the OpenAI names, not specmesh.v1's


async def test_refusals_are_counted_and_requests_metered(edge) -> None:
    session = edge["session"]
    before = await scrape(session)
    for raw in (body(OK, max_tokens=0), body(OK, max_tokens=100_000), b"{"):   # HTTP layer, gRPC layer, HTTP
        async with session.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
    async with session.get("/v1/nope") as r:
        assert r.status == 404
    async with session.post("/v1/completions", json={**OK, "user": "someone"}) as r:
        reply = await r.json()
        assert r.status == 200 and reply["usage"]["completion_tokens"] == 4
    after = await scrape(session)
    errors = "specmesh_request_errors_total"
    assert metric(after, errors, code="INVALID_ARGUMENT") - metric(before, errors, code="INVALID_ARGUMENT") == 3
    assert metric(after, errors, code="NOT_FOUND") - metric(before, errors, code="NOT_FOUND") == 1
    assert metric(after, "specmesh_requests_total") - metric(before, "specmesh_requests_total") == 1
    tokens = "specmesh_generation_tokens_total"
    assert metric(after, tokens) - metric(before, tokens) == 4
    e2e = "specmesh_request_duration_seconds_count"
    assert metric(after, e2e) - metric(before, e2e) == 1
    assert after.count("specmesh_time_to_first_token_seconds_bucket") > 0


async def test_health_version_models_and_tokenize(edge) -> None:
    session = edge["session"]
    for path, method in (("/health", "GET"), ("/ping", "GET"), ("/ping", "POST")):
        async with session.request(method, path) as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
    async with session.get("/version") as r:
        version = await r.json()
    assert version["models"] == ["tiny-target"] and version["version"]
    async with session.get("/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list" and [(m["id"], m["object"]) for m in models["data"]] == [("tiny-target",
                                                                                               "model")]
    async with session.get("/v1/models/tiny-target") as r:
        assert (await r.json())["id"] == "tiny-target"
    tokenizer = edge["gateway"].tokenizer
    async with session.post("/v1/tokenize", json={"model": "tiny-target", "prompt": "The quick brown fox"}) as r:
        tokenized = await r.json()
    expected = tokenizer("The quick brown fox")["input_ids"]
    assert tokenized["tokens"] == expected and tokenized["count"] == len(expected)
    assert tokenized["max_model_len"] == 2048


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("http-certs")
    subprocess.run(["bash", str(MAKE_CERTS), "--out", str(out)], check=True, capture_output=True, timeout=60)
    return out


async def test_https_with_the_gateways_certificate(edge, certs) -> None:
    tls = TlsConfig(tls_cert=str(certs / "gateway.pem"), tls_key=str(certs / "gateway.key"))
    port = edge["grpc_port"]
    https = await start_openai_http(ServedModel("tiny-target", 2048, 0), "127.0.0.1", 0, lambda: f"127.0.0.1:{port}",
                                    ssl_context=http_ssl_context(tls))
    try:
        trusted = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            url = f"https://127.0.0.1:{https.port}"
            async with session.post(f"{url}/v1/completions", json=OK, ssl=trusted) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4
            async with session.get(f"{url}/health", ssl=trusted) as r:
                assert r.status == 200
            with pytest.raises(aiohttp.ClientConnectorCertificateError):       # not trusted without the CA
                await session.get(f"{url}/health")
            with pytest.raises(aiohttp.ClientError):                            # plaintext is not served
                await session.get(f"http://127.0.0.1:{https.port}/health")
    finally:
        await https.close()


async def test_https_requires_client_certificates_when_the_port_does(edge, certs) -> None:
    tls = TlsConfig(tls_cert=str(certs / "gateway.pem"), tls_key=str(certs / "gateway.key"),
                    tls_client_ca=str(certs / "client-ca.pem"))    # end users: the client CA
    https = await start_openai_http(ServedModel("tiny-target", 2048, 0), "127.0.0.1", 0,
                                    lambda: f"127.0.0.1:{edge['grpc_port']}", ssl_context=http_ssl_context(tls))
    try:
        with_cert = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with_cert.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
        without_cert = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            url = f"https://127.0.0.1:{https.port}/v1/models"
            async with session.get(url, ssl=with_cert) as r:
                assert r.status == 200
            with pytest.raises(aiohttp.ClientError):
                async with session.get(url, ssl=without_cert) as r:
                    await r.read()
    finally:
        await https.close()


async def test_the_http_api_reaches_a_gateway_port_that_takes_only_end_user_certificates(edge, certs) -> None:
    tls = TlsConfig(tls_cert=str(certs / "gateway.pem"), tls_key=str(certs / "gateway.key"),
                    tls_client_ca=str(certs / "client-ca.pem"))
    config = GatewayConfig(port=0, verifier_addr=edge["verifier"], draft_addr="", enable_cache=False,
                           enable_ngram=False, suffix_drafting=False, tls=tls)
    gateway = await build_gateway_parts(config, wait_for_verifier_s=30)
    loopback = add_loopback_port(gateway.server)                 # what `python -m gateway` does
    await gateway.server.start("127.0.0.1", 0)
    http = await start_openai_http(ServedModel("tiny-target", 2048, 0), "127.0.0.1", 0, lambda: loopback)
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{http.port}/v1/completions", json=OK) as r:
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4
        socket_dir = Path(loopback.removeprefix("unix:")).parent
        assert socket_dir.stat().st_mode & 0o077 == 0                # only the gateway's user may connect
    finally:
        await http.close()
        await gateway.server.stop(0)
    assert not socket_dir.exists()


class BrokenTokenizer:
    chat_template = None

    def __call__(self, *args: object, **kwargs: object) -> dict:
        raise RuntimeError("a bug")


async def test_an_unexpected_exception_is_a_logged_500_json(caplog) -> None:
    metrics = GatewayMetrics()
    http = await start_openai_http(ServedModel("tiny-target", 2048, 0), "127.0.0.1", 0, lambda: "127.0.0.1:1",
                                   metrics=metrics, tokenizer=BrokenTokenizer())
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{http.port}/v1/tokenize", json={"prompt": "x"}) as r:
            assert r.status == 500 and r.content_type == "application/json"
            error = (await r.json())["error"]
        assert error["type"] == "server_error" and "a bug" not in error["message"]
        assert "RuntimeError: a bug" in caplog.text                       # the traceback is logged
        assert metrics.registry.get_sample_value("specmesh_request_errors_total", {"code": "INTERNAL"}) == 1
    finally:
        await http.close()


class FailingStream:
    """A Generate call that yields one response and then hits a bug."""

    def __init__(self) -> None:
        self.cancelled = False

    def __aiter__(self):  # noqa: ANN204
        return self._responses()

    async def _responses(self):  # noqa: ANN202
        yield generate_pb2.GenerateResponse(request_id="r1", text="Hi")
        raise RuntimeError("a bug mid-stream")

    def cancel(self) -> None:
        self.cancelled = True


class FakeChannel:
    def __init__(self) -> None:
        self.calls: list[FailingStream] = []

    def unary_stream(self, *args: object, **kwargs: object):  # noqa: ANN201
        def start(request: object, metadata: object = None) -> FailingStream:
            self.calls.append(FailingStream())
            return self.calls[-1]
        return start

    def unary_unary(self, *args: object, **kwargs: object) -> None:
        return None

    async def close(self) -> None:
        pass


async def test_a_bug_mid_stream_ends_it_with_an_error_event(caplog) -> None:
    channel, metrics = FakeChannel(), GatewayMetrics()
    http = await start_openai_http(ServedModel("tiny-target", 2048, 0), "127.0.0.1", 0, lambda: "unused",
                                   lambda _: channel, metrics=metrics)
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{http.port}/v1/completions", json={**OK, "stream": True}) as r:
            assert r.status == 200
            events = [line.removeprefix("data: ") for line in (await r.text()).splitlines() if line]
        assert json.loads(events[0])["choices"][0]["text"] == "Hi"
        assert json.loads(events[-1])["error"]["type"] == "server_error" and "[DONE]" not in events
        assert channel.calls[0].cancelled and "RuntimeError: a bug mid-stream" in caplog.text
        assert metrics.registry.get_sample_value("specmesh_request_errors_total", {"code": "INTERNAL"}) == 1
    finally:
        await http.close()


@pytest.mark.parametrize(("headers", "status"), [
    ({}, 401), ({"Authorization": "Basic key-1"}, 401), ({"Authorization": "Bearer nope"}, 403),
    ({"Authorization": "Bearer key-1", "X-Specmesh-Tenant": "team-b"}, 403),
    ({"Authorization": "Bearer key-1", "X-Specmesh-Tenant": "team-a"}, 200), ({"Authorization": "Bearer key-1"}, 200)],
    ids=["no-key", "not-bearer", "wrong-key", "other-tenant", "own-tenant", "key"])
async def test_api_keys_guard_every_v1_route_with_the_grpc_rule(edge, headers, status) -> None:
    gateway = edge["gateway"]
    http = await start_openai_http(ServedModel("tiny-target", 2048, 0), "127.0.0.1", 0,
                                   lambda: f"127.0.0.1:{edge['grpc_port']}", metrics=GatewayMetrics(),
                                   tokenizer=gateway.tokenizer, api_keys={"key-1": "team-a"})
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{http.port}") as session:
            for method, path, payload in (("POST", "/v1/tokenize", {"prompt": "x"}), ("GET", "/v1/models", None)):
                async with session.request(method, path, json=payload, headers=headers) as r:
                    assert r.status == status and r.content_type == "application/json"
                    if status != 200:
                        code = (await r.json())["error"]["code"]
                        assert code == ("unauthenticated" if status == 401 else "permission_denied")
            async with session.get("/health") as r:                   # probes stay open
                assert r.status == 200
        refused = http.metrics.registry.get_sample_value(
            "specmesh_request_errors_total", {"code": "UNAUTHENTICATED" if status == 401 else "PERMISSION_DENIED"})
        assert refused == (None if status == 200 else 2)
    finally:
        await http.close()


async def test_a_client_that_left_is_neither_logged_as_a_bug_nor_answered(caplog) -> None:
    """A load generator cancels streams at the end of each rate: writing the headers then fails with the transport
    closing. That is no internal error: no traceback, no 500 body, nothing counted; aiohttp drops the connection."""
    async def handler(request: Any) -> Any:
        raise ClientConnectionResetError("Cannot write to closing transport")

    request = make_mocked_request("POST", "/v1/chat/completions")
    with caplog.at_level(logging.DEBUG, logger="gateway.http_edge"), pytest.raises(ConnectionResetError):
        await error_middleware(None)(request, handler)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_bug_is_logged_and_answered_as_an_internal_error(caplog) -> None:
    async def handler(request: Any) -> Any:
        raise RuntimeError("boom")

    response = await error_middleware(None)(make_mocked_request("GET", "/v1/models"), handler)
    assert response.status == 500
    assert any(r.levelno >= logging.ERROR for r in caplog.records)
