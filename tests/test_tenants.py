"""API keys bound to tenants: an authenticated request's cache tenant is its key's, a tenant header naming another
tenant is PERMISSION_DENIED (gRPC and HTTP), and one key's cached drafts never reach another key."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest
import pytest_asyncio

from gateway.openai_http import ServedModel, start_openai_http
from protos.specmesh.v1 import common_pb2, generate_pb2_grpc
from specmesh.config import GatewayConfig
from specmesh.ops import client
from specmesh.rpc.security import (
    DEFAULT_TENANT,
    Denied,
    load_api_keys,
    parse_api_keys,
    resolve_tenant,
    unbound_key_tenant,
)
from tests.stack import start_gateway, start_verifier

KEYS = {"key-a": "acme", "key-b": "beta", "key-plain": ""}
CACHE = common_pb2.DRAFT_SOURCE_CACHE
PROMPT = "Where is my order number 51423?"


def test_entries_bind_keys_to_tenants(tmp_path) -> None:
    assert parse_api_keys(["key-a:acme", " key-b : beta ", "key-plain", "", "# comment"]) == KEYS
    for bad in (["key-a:"], [":acme"], ["key-a:acme", "key-a:beta"]):
        with pytest.raises(ValueError) as info:
            parse_api_keys(bad)
        assert "key-a" not in str(info.value)                         # errors never echo a key
    keys_file = tmp_path / "keys"
    keys_file.write_text("# one per line\nkey-b:beta\nkey-plain\n")
    assert load_api_keys(GatewayConfig(api_keys="key-a:acme", api_keys_file=str(keys_file))) == KEYS


def test_resolve_tenant() -> None:
    assert resolve_tenant({}, None, None) == DEFAULT_TENANT             # no keys: the header names the tenant
    assert resolve_tenant({}, None, "acme") == "acme"
    assert resolve_tenant(KEYS, "Bearer key-a", None) == "acme"
    assert resolve_tenant(KEYS, "bearer key-a", "acme") == "acme"       # repeating the key's own tenant is fine
    plain = unbound_key_tenant("key-plain")
    assert plain.startswith("key-") and "plain" not in plain and plain != unbound_key_tenant("key-a")
    assert resolve_tenant(KEYS, "Bearer key-plain", None) == plain
    refusals = {("Bearer key-b", "acme"): grpc.StatusCode.PERMISSION_DENIED,
                ("Bearer key-plain", "acme"): grpc.StatusCode.PERMISSION_DENIED,
                ("Bearer key-c", None): grpc.StatusCode.PERMISSION_DENIED,
                (None, "acme"): grpc.StatusCode.UNAUTHENTICATED,
                ("Basic key-a", None): grpc.StatusCode.UNAUTHENTICATED}
    for (authorization, header), code in refusals.items():
        verdict = resolve_tenant(KEYS, authorization, header)
        assert isinstance(verdict, Denied) and verdict.code == code, (authorization, header)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway():
    verifier = await start_verifier()
    running = await start_gateway(verifier.addr, "", enable_cache=True,
                                  api_keys="key-a:acme,key-b:beta,key-plain")
    http = await start_openai_http(ServedModel("tiny-target", 1024, 0), "127.0.0.1", 0, lambda: running.addr)
    yield {"grpc": running.addr, "http": http.port}
    await http.close()
    for server in (running, verifier):
        await server.stop()


async def generate(addr: str, key: str, tenant: str | None = None) -> list:
    metadata = [("authorization", f"Bearer {key}")] + ([("x-specmesh-tenant", tenant)] if tenant else [])
    request = client.make_request(PROMPT, max_new_tokens=24, ignore_eos=True, num_draft_tokens=4)
    async with grpc.aio.insecure_channel(addr) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata, timeout=120)
        return [r async for r in call]


def cache_rounds(responses: list) -> int:
    return sum(1 for r in responses if r.round.round > 0 and r.round.draft_source == CACHE)


async def test_a_key_cannot_act_for_another_tenant(gateway) -> None:
    for key in ("key-b", "key-plain"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(gateway["grpc"], key, tenant="acme")
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert await generate(gateway["grpc"], "key-a", tenant="acme")      # its own tenant: fine


async def test_cached_drafts_stay_with_the_key_that_made_them(gateway) -> None:
    first = await generate(gateway["grpc"], "key-a")
    await asyncio.sleep(0.1)
    other = await generate(gateway["grpc"], "key-b")
    plain = await generate(gateway["grpc"], "key-plain")
    again = await generate(gateway["grpc"], "key-a", tenant="acme")
    ids = [[t for r in responses for t in r.token_ids] for responses in (first, other, plain, again)]
    assert ids[1:] == [ids[0]] * 3                                      # the cache never changes output
    assert cache_rounds(other) == 0 and cache_rounds(plain) == 0      # neither sees acme's drafts
    assert cache_rounds(again) > 0                                      # acme does


@pytest.mark.parametrize(("key", "tenant", "status"), [("key-b", "acme", 403), ("key-a", "acme", 200),
                                                       ("key-a", None, 200)])
async def test_http_api_applies_the_same_rule(gateway, key, tenant, status) -> None:
    headers = {"authorization": f"Bearer {key}"} | ({"x-specmesh-tenant": tenant} if tenant else {})
    body = {"model": "tiny-target", "prompt": PROMPT, "max_tokens": 4}
    url = f"http://127.0.0.1:{gateway['http']}/v1/completions"
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as response:
        assert response.status == status
