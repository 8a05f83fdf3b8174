"""Streams outlive their verifier: two replica processes behind one gateway, six greedy streams, the replica holding
sessions killed, frozen or drained mid-stream. Every stream completes identical to target-only greedy decoding."""

from __future__ import annotations

import asyncio
import signal
import subprocess

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from transformers import AutoTokenizer

from gateway.draft_link import BACKOFF_ROUNDS
from gateway.server import Gateway, build_gateway_parts
from protos.specmesh.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specmesh.config import GatewayConfig
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from specmesh.telemetry.tracing import add_exporter
from tests.stack import reference_greedy, start_draft, start_gateway, start_verifier
from tests.test_faults import PROMPT, free_port, spawn

NUM_STREAMS, NUM_TOKENS = 6, 300


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    memory = InMemorySpanExporter()
    add_exporter(memory, "specmesh-test", batch=False)      # the in-process gateway's spans
    yield memory
    memory.shutdown()


@pytest.fixture(scope="module")
def expected() -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    return reference_greedy(tok(PROMPT)["input_ids"], NUM_TOKENS)


async def start(num_replicas: int = 2) -> tuple[list[subprocess.Popen[bytes]], list[str], Gateway]:
    ports = [free_port() for _ in range(num_replicas)]
    procs = list(await asyncio.gather(*(spawn("verifier_service", "VERIFIER", p, "tiny-target") for p in ports)))
    addrs = [f"127.0.0.1:{p}" for p in ports]
    config = GatewayConfig(port=0, verifier_addr=",".join(addrs), draft_addr="", enable_cache=False,
                           enable_ngram=False, suffix_drafting=False, adaptive_draft_length=False)
    gateway = await build_gateway_parts(config, wait_for_verifier_s=30)
    await gateway.server.start("127.0.0.1", 0)
    return procs, addrs, gateway


async def num_sessions(addr: str) -> int:
    async with grpc.aio.insecure_channel(addr) as channel:
        info = await verifier_pb2_grpc.VerifierStub(channel).GetModelInfo(verifier_pb2.GetModelInfoRequest(),
                                                                          timeout=5)
    return info.num_sessions


async def streams_then(gateway: Gateway, disturb, num_tokens: int = NUM_TOKENS) -> list:
    """NUM_STREAMS greedy streams; `disturb()` once every stream has received tokens. Results or exceptions."""
    started = [asyncio.Event() for _ in range(NUM_STREAMS)]

    async def one(i: int) -> list[int]:
        ids: list[int] = []
        request = client.make_request(PROMPT, max_new_tokens=num_tokens, ignore_eos=True, num_draft_tokens=3)
        async for r in client.stream(f"127.0.0.1:{gateway.server.port}", request, timeout_s=300):
            ids.extend(r.token_ids)
            if len(ids) >= 2:
                started[i].set()
        return ids

    tasks = [asyncio.ensure_future(one(i)) for i in range(NUM_STREAMS)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    await disturb()
    return await asyncio.gather(*tasks, return_exceptions=True)


def failovers(gateway: Gateway, reason: str, outcome: str = "moved") -> float:
    value = gateway.metrics.registry.get_sample_value("specmesh_gateway_failovers_total",
                                                      {"reason": reason, "outcome": outcome})
    return value or 0.0


async def busiest(addrs: list[str]) -> int:
    counts = [await num_sessions(a) for a in addrs]
    assert sum(counts) == NUM_STREAMS
    return counts.index(max(counts))


@pytest.mark.parametrize("how", ["kill", "freeze"])
async def test_streams_move_when_their_replica_dies(expected, spans, how: str) -> None:
    """kill: Verify fails UNAVAILABLE. freeze (SIGSTOP): the connection stays open and nothing answers; the health
    watch marks the replica down and the waiting Verify moves."""
    procs, addrs, gateway = await start()
    holder: list[int] = []
    try:
        async def disturb() -> None:
            holder.append(await busiest(addrs))
            procs[holder[0]].send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)

        results = await streams_then(gateway, disturb)
        assert all(r == expected for r in results), [r if isinstance(r, Exception) else len(r) for r in results]
        reason = "unavailable" if how == "kill" else "lost"
        assert failovers(gateway, reason) >= 1 and failovers(gateway, reason, "failed") == 0
        events = [e for span in spans.get_finished_spans() for e in span.events if e.name == "specmesh.failover"
                  and e.attributes["specmesh.failover.from"] == addrs[holder[0]]]
        assert len(events) == failovers(gateway, reason)              # each move marked on its request's span
        assert all(e.attributes["specmesh.failover.to"] == addrs[1 - holder[0]] for e in events)
        assert all(0 < e.attributes["specmesh.failover.tokens_emitted"] < NUM_TOKENS for e in events)
        survivor = addrs[1 - holder[0]]
        for _ in range(100):                               # every session ended on the survivor (EndSession)
            if await num_sessions(survivor) == 0:
                break
            await asyncio.sleep(0.1)
        assert await num_sessions(survivor) == 0
    finally:
        for proc in procs:
            proc.kill()
        await gateway.server.stop(0)


async def test_a_draining_replicas_streams_move_instead_of_waiting(expected) -> None:
    procs, addrs, gateway = await start()
    try:
        holder: list[int] = []

        async def disturb() -> None:
            holder.append(await busiest(addrs))
            procs[holder[0]].send_signal(signal.SIGTERM)

        moved_before = failovers(gateway, "draining")
        results = await streams_then(gateway, disturb)
        assert all(r == expected for r in results)
        assert failovers(gateway, "draining") - moved_before >= 1
        assert await asyncio.to_thread(procs[holder[0]].wait, 30) == 0          # drained (its sessions left)
    finally:
        for proc in procs:
            proc.kill()
        await gateway.server.stop(0)


async def test_no_replica_left_ends_the_stream_unavailable() -> None:
    procs, _, gateway = await start()
    try:
        async def disturb() -> None:
            for proc in procs:
                proc.kill()

        results = await streams_then(gateway, disturb, num_tokens=900)
        assert all(isinstance(r, grpc.aio.AioRpcError) for r in results), results
        assert {r.code() for r in results} == {grpc.StatusCode.UNAVAILABLE}
        assert all("no replica left to continue the stream" in r.details() for r in results), results[0].details()
        assert failovers(gateway, "unavailable", "failed") + failovers(gateway, "lost", "failed") == NUM_STREAMS
    finally:
        for proc in procs:
            proc.kill()
        await gateway.server.stop(0)



async def test_the_draft_session_follows_to_another_draft_replica(expected) -> None:
    """The stream's draft replica stops: a few target-only rounds (as with one replica), then its drafts come from
    the other replica (the whole-context resend opens the session there). Output unchanged."""
    verifier = await start_verifier(decode_ahead_tokens=8)
    drafts = [await start_draft(), await start_draft()]
    gateway = await start_gateway(verifier.addr, ",".join(d.addr for d in drafts), draft_timeout_s=2.0)
    try:
        responses = []
        request = client.make_request(PROMPT, max_new_tokens=NUM_TOKENS, ignore_eos=True, num_draft_tokens=3)
        async for r in client.stream(gateway.addr, request, timeout_s=120):
            responses.append(r)
            if len(responses) == 2:
                used = [d for d in drafts if d.engine.sessions]
                assert len(used) == 1                      # one draft replica holds the request's session
                await used[0].stop()
        assert [t for r in responses for t in r.token_ids] == expected
        late = responses[2 + BACKOFF_ROUNDS + 2:]                 # after the backoff: only the other replica is up
        assert any(r.round.num_drafted and r.round.draft_source == common_pb2.DRAFT_SOURCE_MODEL for r in late)
    finally:
        await gateway.stop()
        await verifier.stop()
        for d in drafts:
            await d.stop()
