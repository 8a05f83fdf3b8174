"""Discovery: dns:/// names re-resolved (injectable resolver), a replica appearing and one disappearing; sessions
stay pinned to the replica they started on."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from gateway.discovery import Discovery, Entry, parse_addrs
from gateway.server import build_gateway_parts
from specmesh.config import GatewayConfig
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from tests.stack import reference_greedy, start_verifier
from tests.test_placement import CountingStub


def test_parse_addrs_names_the_field() -> None:
    assert parse_addrs(" a:1, dns:///svc.ns:50061 ,", "verifier_addr") == [Entry("a:1", False),
                                                                           Entry("svc.ns:50061", True)]
    assert Entry("svc.ns:50061", True).host_port == ("svc.ns", 50061)
    with pytest.raises(ValueError, match="verifier_addr: 'dns:///svc' is not host:port"):
        parse_addrs("dns:///svc", "verifier_addr")


async def test_refresh_follows_the_records_and_keeps_them_through_a_failed_lookup() -> None:
    answers: dict[str, list[str] | OSError] = {"svc": ["10.0.0.1:7", "10.0.0.2:7"]}
    seen: list[list[str]] = []

    async def resolver(host: str, port: int) -> list[str]:
        answer = answers[host]
        if isinstance(answer, OSError):
            raise answer
        return answer

    discovery = Discovery(parse_addrs("fixed:1,dns:///svc:7", "x"), seen.append, resolver)
    assert await discovery.refresh() == ["fixed:1", "10.0.0.1:7", "10.0.0.2:7"]
    answers["svc"] = ["10.0.0.2:7", "10.0.0.3:7"]                  # one pod gone, one new
    assert await discovery.refresh() == ["fixed:1", "10.0.0.2:7", "10.0.0.3:7"]
    answers["svc"] = OSError("Temporary failure in name resolution")
    assert await discovery.refresh() == ["fixed:1", "10.0.0.2:7", "10.0.0.3:7"]   # a blip empties nothing
    assert len(seen) == 2 and discovery.server_names["10.0.0.3:7"] == "svc"


async def test_gateway_follows_dns_a_replica_appears_and_one_disappears() -> None:
    a, b = await start_verifier(), await start_verifier()
    records = [a.addr]

    async def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("verifiers.test", 50061)
        return list(records)

    config = GatewayConfig(port=0, verifier_addr="dns:///verifiers.test:50061", draft_addr="", enable_cache=False,
                           enable_ngram=False, suffix_drafting=False, adaptive_draft_length=False,
                           discovery_interval_s=0.05)
    gateway = await build_gateway_parts(config, wait_for_verifier_s=30, resolver=resolver)
    port = await gateway.server.start("127.0.0.1", 0)
    pool = gateway.verifiers
    counted = pool.replicas[a.addr].stub = CountingStub(pool.replicas[a.addr].stub)   # type: ignore[assignment]
    stubs = {a.addr: counted}
    make = pool.make_stub

    def counting(addr: str):  # noqa: ANN202
        stub, channel = make(addr)
        stubs[addr] = CountingStub(stub)
        return stubs[addr], channel

    pool.make_stub = counting                                     # type: ignore[assignment]
    addr = f"127.0.0.1:{port}"
    prompt_ids = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))("x")["input_ids"]
    expected = reference_greedy(prompt_ids, 200)
    try:
        long_stream = asyncio.ensure_future(stream_ids(addr, "x", 200))   # started on a, the only replica
        while counted.started == 0:
            await asyncio.sleep(0.01)
        records.append(b.addr)                                    # a new replica
        while b.addr not in pool.replicas:
            await asyncio.sleep(0.01)
        for _ in range(4):
            await stream_ids(addr, "y", 2)
        assert stubs[b.addr].started >= 2                         # it gets sessions (equal load: they alternate)
        records.remove(a.addr)                                    # a leaves DNS while its session runs
        while a.addr in pool.replicas:
            await asyncio.sleep(0.01)
        before = counted.started
        for _ in range(3):
            await stream_ids(addr, "z", 2)
        assert counted.started == before                          # no new session on a removed replica
        assert await long_stream == expected                      # the pinned session finished on a, whole
        assert gateway.metrics.registry.get_sample_value("specmesh_gateway_failovers_total",
                                                         {"reason": "lost", "outcome": "moved"}) is None
    finally:
        await gateway.server.stop(0)
        await a.stop()
        await b.stop()


async def stream_ids(addr: str, prompt: str, n: int) -> list[int]:
    ids: list[int] = []
    request = client.make_request(prompt, max_new_tokens=n, ignore_eos=True)
    async for r in client.stream(addr, request, timeout_s=60):
        ids.extend(r.token_ids)
    return ids
