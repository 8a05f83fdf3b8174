"""TLS on every gRPC hop with deploy/make_certs.sh certificates, mutual TLS to the internal services (which only the
gateway's identity may call), and API keys on the public API (gRPC and the OpenAI-compatible HTTP API)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.server import build_draft
from gateway.openai_http import ServedModel, loopback_channel_factory, start_openai_http
from gateway.server import build_gateway
from protos.specmesh.v1 import common_pb2, draft_pb2_grpc, generate_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specmesh.config import DraftConfig, EngineConfig, GatewayConfig, TlsConfig, VerifierConfig
from specmesh.ops import client
from specmesh.rpc.security import peer_interceptors, peer_names, server_credentials
from tests.test_node_client import ensure_node_client, run_node
from verifier_service.server import build_verifier

MAKE_CERTS = Path(__file__).resolve().parent.parent / "deploy" / "make_certs.sh"
REQUEST = client.make_request("The quick brown fox", max_new_tokens=8, ignore_eos=True, num_draft_tokens=3)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two runs of make_certs.sh: `good` signs every service (and its client CA the client), `other` is wrong."""
    dirs = {name: tmp_path_factory.mktemp(f"certs-{name}") for name in ("good", "other")}
    for d in dirs.values():
        subprocess.run(["bash", str(MAKE_CERTS), "--out", str(d)], check=True, capture_output=True, timeout=60)
    return dirs


def service_tls(d: Path, name: str, mutual: bool, client_ca: str = "ca.pem") -> TlsConfig:
    """Serves with <name>.pem; when mutual, requires client certificates from client_ca and lets only the gateway
    call; calls others with ca.pem + its cert (the documented secure deployment)."""
    return TlsConfig(tls_cert=str(d / f"{name}.pem"), tls_key=str(d / f"{name}.key"),
                     tls_client_ca=str(d / client_ca) if mutual else "", tls_ca=str(d / "ca.pem"),
                     tls_client_cert=str(d / f"{name}.pem"), tls_client_key=str(d / f"{name}.key"),
                     tls_allowed_peers="gateway" if mutual else "")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(certs):
    good = certs["good"]
    engine = EngineConfig(model="tiny-target", kv_cache_memory_mb=16)
    verifier, v_engine = build_verifier(VerifierConfig(port=0, engine=engine, tls=service_tls(good, "verifier", True)))
    v_port = await verifier.start("127.0.0.1", 0)
    draft, d_engine = build_draft(DraftConfig(port=0, engine=EngineConfig(model="tiny-draft", kv_cache_memory_mb=16),
                                              tls=service_tls(good, "draft", True)))
    d_port = await draft.start("127.0.0.1", 0)
    (good / "both-cas.pem").write_bytes((good / "ca.pem").read_bytes() + (good / "client-ca.pem").read_bytes())
    lax, lax_engine = build_draft(DraftConfig(port=0, engine=EngineConfig(model="tiny-draft", kv_cache_memory_mb=16),
                                              tls=service_tls(good, "draft", True, client_ca="both-cas.pem")))
    lax_port = await lax.start("127.0.0.1", 0)               # trusts the client CA too: only the name check is left
    config = GatewayConfig(port=0, verifier_addr=f"127.0.0.1:{v_port}", draft_addr=f"127.0.0.1:{d_port}",
                           enable_cache=False, enable_ngram=False, suffix_drafting=False, api_keys="key-1, key-2",
                           tls=service_tls(good, "gateway", False))
    gateway = await build_gateway(config, wait_for_verifier_s=30)
    g_port = await gateway.start("127.0.0.1", 0)
    http = await start_openai_http(ServedModel("tiny-target", 1024, 0), "127.0.0.1", 0,
                                   lambda: f"127.0.0.1:{g_port}", loopback_channel_factory(config))
    yield {"gateway": f"127.0.0.1:{g_port}", "verifier": f"127.0.0.1:{v_port}", "draft": f"127.0.0.1:{d_port}",
           "lax-draft": f"127.0.0.1:{lax_port}", "http": http.port}
    await http.close()
    for server in (gateway, lax, draft, verifier):
        await server.stop(0)
    for engine_ in (v_engine, d_engine, lax_engine):
        engine_.stop()


def tls_channel(addr: str, ca: Path | None, cert_dir: Path | None = None, name: str = "client") -> grpc.aio.Channel:
    if ca is None:
        return grpc.aio.insecure_channel(addr)
    key = (cert_dir / f"{name}.key").read_bytes() if cert_dir else None
    chain = (cert_dir / f"{name}.pem").read_bytes() if cert_dir else None
    return grpc.aio.secure_channel(addr, grpc.ssl_channel_credentials(ca.read_bytes(), key, chain))


async def complete(addr: str, ca: Path | None, key: str | None):
    metadata = (("authorization", key),) if key is not None else ()
    async with tls_channel(addr, ca) as channel:
        return await generate_pb2_grpc.GenerationStub(channel).Complete(REQUEST, metadata=metadata, timeout=60)


async def test_generation_over_tls_and_mutual_tls(stack, certs) -> None:
    reply = await complete(stack["gateway"], certs["good"] / "ca.pem", "Bearer key-2")
    assert reply.usage.completion_tokens == 8
    assert reply.usage.num_drafted_tokens > 0          # the gateway -> draft hop (mutual TLS) worked too


@pytest.mark.parametrize("ca", ["other", None], ids=["wrong-ca", "plaintext"])
async def test_wrong_ca_or_plaintext_fails_the_handshake(stack, certs, ca) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await complete(stack["gateway"], certs[ca] / "ca.pem" if ca else None, "Bearer key-1")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def internal_call(stack: dict, service: str, certs: dict[str, Path], cert_dir: str | None,
                        name: str) -> str:
    """Calls a verifier (GetModelInfo) or draft service (EndSession of no session) with <cert_dir>/<name>.pem:
    "served" (the service answered, an error of its own included), "no handshake" or "wrong identity"."""
    channel = tls_channel(stack[service], certs["good"] / "ca.pem", certs[cert_dir] if cert_dir else None, name)
    async with channel:
        try:
            if service == "verifier":
                info = await verifier_pb2_grpc.VerifierStub(channel).GetModelInfo(verifier_pb2.GetModelInfoRequest(),
                                                                                  timeout=10)
                assert info.model_name == "tiny-target"
            else:
                await draft_pb2_grpc.DraftStub(channel).EndSession(common_pb2.EndSessionRequest(session_id="none"),
                                                                   timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return "no handshake"
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED and "client certificate" in (exc.details() or ""):
                return "wrong identity"
    return "served"


CALLERS = {"gateway-cert": ("good", "gateway", "served"),
           "end-user-client-cert": ("good", "client", "no handshake"),          # signed by the client CA
           "other-internal-cert": ("good", "draft", "wrong identity"),          # the internal CA, but not the gateway
           "no-client-cert": (None, "client", "no handshake"),
           "cert-from-wrong-ca": ("other", "gateway", "no handshake")}


@pytest.mark.parametrize("service", ["verifier", "draft"])
@pytest.mark.parametrize("caller", list(CALLERS))
async def test_internal_services_accept_only_the_gateway(stack, certs, service, caller) -> None:
    cert_dir, name, outcome = CALLERS[caller]
    assert await internal_call(stack, service, certs, cert_dir, name) == outcome


@pytest.mark.parametrize(("name", "outcome"), [("gateway", "served"), ("client", "wrong identity")])
async def test_peer_names_are_checked_even_when_the_client_ca_is_trusted(stack, certs, name, outcome) -> None:
    assert await internal_call(stack, "lax-draft", certs, "good", name) == outcome


def test_allowed_peers_need_mutual_tls_and_name_the_certificate(certs) -> None:
    good = certs["good"]
    with pytest.raises(ValueError, match="mutual TLS"):
        server_credentials(TlsConfig(tls_allowed_peers="gateway"))                   # before any model is loaded
    with pytest.raises(ValueError, match="mutual TLS"):
        peer_interceptors(dataclasses.replace(service_tls(good, "verifier", False), tls_allowed_peers="gateway"))
    assert peer_interceptors(service_tls(good, "verifier", False)) == []            # not set: no check
    assert peer_names({"x509_common_name": [b"gateway"],
                       "x509_subject_alternative_name": [b"specmesh-gateway", b"localhost"]}) == {
        "gateway", "specmesh-gateway", "localhost"}
    assert peer_names({}) == set()                                                   # no client certificate


async def test_health_of_internal_services_stays_open_to_their_own_certificate(stack, certs) -> None:
    async with tls_channel(stack["verifier"], certs["good"] / "ca.pem", certs["good"], "verifier") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING          # the compose health check's identity


@pytest.mark.parametrize(("key", "code"), [(None, grpc.StatusCode.UNAUTHENTICATED),
                                           ("Basic key-1", grpc.StatusCode.UNAUTHENTICATED),
                                           ("Bearer ", grpc.StatusCode.UNAUTHENTICATED),
                                           ("Bearer key-3", grpc.StatusCode.PERMISSION_DENIED)])
async def test_missing_or_wrong_api_key_is_rejected(stack, certs, key, code) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await complete(stack["gateway"], certs["good"] / "ca.pem", key)
    assert info.value.code() == code
    async with tls_channel(stack["gateway"], certs["good"] / "ca.pem") as channel:   # streaming is guarded too
        call = generate_pb2_grpc.GenerationStub(channel).Generate(REQUEST, metadata=(("authorization", key or ""),))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == code


async def test_health_stays_open_and_healthcheck_cli_speaks_tls(stack, certs) -> None:
    async with tls_channel(stack["gateway"], certs["good"] / "ca.pem") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    for extra, expected in ((["--ca", str(certs["good"] / "ca.pem")], 0), ([], 2)):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "specmesh.ops.healthcheck", stack["gateway"],
                                                    *extra, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        assert await proc.wait() == expected


async def test_openai_http_forwards_the_api_key(stack) -> None:
    base = f"http://127.0.0.1:{stack['http']}/v1"
    api = openai.AsyncOpenAI(base_url=base, api_key="key-1", max_retries=0)
    reply = await api.completions.create(model="tiny-target", prompt="The quick", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4
    with pytest.raises(openai.PermissionDeniedError):
        await openai.AsyncOpenAI(base_url=base, api_key="nope", max_retries=0).completions.create(
            model="tiny-target", prompt="x", max_tokens=4)
    body = {"model": "tiny-target", "prompt": "x"}
    async with aiohttp.ClientSession() as session, session.post(f"{base}/completions", json=body) as response:
        assert response.status == 401
        assert (await response.json())["error"]["code"] == "unauthenticated"
    await api.close()


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (Node.js 18+ needed)")
async def test_node_client_speaks_tls_with_an_api_key(stack, certs) -> None:
    node_client = (await asyncio.to_thread(ensure_node_client))[:2]        # node examples/node/client.js
    expected = await complete(stack["gateway"], certs["good"] / "ca.pem", "Bearer key-1")
    args = ["--addr", stack["gateway"], "--ca", str(certs["good"] / "ca.pem"), "--max-new-tokens", "8",
            "--ignore-eos", "--num-draft-tokens", "3", "--json"]
    code, out, err = await run_node([*node_client, *args, "--api-key", "key-1", "The quick brown fox"])
    assert code == 0, err
    assert json.loads(out)["text"] == expected.text
    code, _, err = await run_node([*node_client, *args, "--api-key", "wrong", "The quick brown fox"])
    assert code == 1 and "PERMISSION_DENIED" in err
