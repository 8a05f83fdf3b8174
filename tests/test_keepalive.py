"""Backpressure without loss: a stream that reads nothing for twice the session lease, then reads, gets its whole
output, identical to an undisturbed run; no session expired on either service (gateway/keepalive.py). Errors of
the verifier name it and never the internal session id (gateway/upstream_errors.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import grpc
import pytest
import pytest_asyncio

from draft_service.server import build_draft
from gateway.draft_pool import DraftPool
from gateway.keepalive import SessionKeepAlive, keepalive_interval_s, model_drafter_of
from gateway.replicas import VerifierPool
from gateway.server import load_tokenizer
from gateway.servicer import GenerationServicer, ModelInfo
from gateway.upstream_errors import public_details
from protos.specmesh.v1 import common_pb2, draft_pb2_grpc, generate_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specmesh.config import DraftConfig, EngineConfig, GatewayConfig, VerifierConfig
from specmesh.ops import client
from tests.stack import Running, start_gateway
from verifier_service.server import build_verifier

LEASE_S = 1.5
PROMPT = "Once upon a time, in a city on a high valley,"


def test_interval_is_a_third_of_the_shortest_lease() -> None:
    assert keepalive_interval_s(0.0, [60.0, 0.0]) == 20.0
    assert keepalive_interval_s(0.0, [60.0, 3.0]) == 1.0
    assert keepalive_interval_s(0.0, [0.0]) == 20.0                  # nobody said: 20 s
    assert keepalive_interval_s(5.0, [3.0]) == 5.0                   # configured wins
    assert model_drafter_of(None) is None


class CountingVerifier:
    def __init__(self, lease_s: float) -> None:
        self.lease_s, self.calls = lease_s, 0

    async def _answer(self) -> common_pb2.KeepAliveResponse:
        return common_pb2.KeepAliveResponse(lease_s=self.lease_s)

    def KeepAlive(self, request: common_pb2.KeepAliveRequest, timeout: float):  # noqa: ANN201, N802
        assert request.session_id == "sid" and request.owner_token == "tok"
        self.calls += 1
        return self._answer()


async def test_renewals_follow_the_lease_on_a_virtual_clock() -> None:
    now = [0.0]

    async def sleep(seconds: float) -> None:
        now[0] += seconds
        await asyncio.sleep(0)

    verifier = CountingVerifier(lease_s=6.0)
    session = types.SimpleNamespace(replica=types.SimpleNamespace(stub=verifier), owner_token="", lease_s=0.0)
    generation = types.SimpleNamespace(session=session, session_id="sid", drafter=None)
    keepalive = SessionKeepAlive(generation, sleep=sleep, clock=lambda: now[0])   # type: ignore[arg-type]
    keepalive.start()
    while now[0] < 30.0:                              # no session yet: nothing to renew
        await asyncio.sleep(0)
    assert verifier.calls == 0
    session.owner_token, session.lease_s = "tok", 6.0               # StartSession answered
    start = now[0]
    while now[0] < start + 20.0:
        await asyncio.sleep(0)
    keepalive.stop()
    assert keepalive.interval_s() == 2.0 and 9 <= verifier.calls <= 10    # every lease / 3
    assert keepalive.num_renewals == verifier.calls


def test_errors_never_show_the_internal_session_id() -> None:
    details = "session req-1-ab12cd34 is not open or owner_token does not match"
    message = public_details("verifier", details, ("req-1-ab12cd34",))
    assert message == "verifier: this request's session is not open or owner_token does not match"
    assert public_details("verifier", "", ("x",)) == "verifier: failed"


class PausedContext:
    """The servicer's view of a client: no deadline, no metadata."""

    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def expired(running: Running) -> float:
    return running.engine.metrics.registry.get_sample_value("specmesh_sessions_expired_total") or 0.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def leased():
    engine = EngineConfig(model="tiny-target", kv_cache_memory_mb=16, max_model_len=512)
    v_server, v_engine = build_verifier(VerifierConfig(port=0, session_lease_s=LEASE_S, engine=engine,
                                                       decode_ahead_tokens=8))
    verifier = Running(v_server, await v_server.start("127.0.0.1", 0), v_engine)
    d_server, d_engine = build_draft(DraftConfig(port=0, session_lease_s=LEASE_S,
                                                 engine=dataclasses.replace(engine, model="tiny-draft")))
    draft = Running(d_server, await d_server.start("127.0.0.1", 0), d_engine)
    v_channel, d_channel = grpc.aio.insecure_channel(verifier.addr), grpc.aio.insecure_channel(draft.addr)
    v_stub = verifier_pb2_grpc.VerifierStub(v_channel)
    info = await v_stub.GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=30)
    config = GatewayConfig(adaptive_draft_length=False, enable_cache=False, enable_ngram=False, suffix_drafting=False)
    servicer = GenerationServicer(config, load_tokenizer("tiny-target", ""),
                                  ModelInfo(info.model_name, info.max_model_len, frozenset(info.eos_token_ids)),
                                  VerifierPool.of_stubs([v_stub]),
                                  DraftPool(lambda _addr: (draft_pb2_grpc.DraftStub(d_channel), None), ["draft"]))
    yield servicer, verifier, draft
    await v_channel.close()
    await d_channel.close()
    for running in (draft, verifier):
        await running.stop()


async def test_a_stream_paused_for_twice_the_lease_loses_nothing(leased) -> None:
    servicer, verifier, draft = leased
    request = client.make_request(PROMPT, max_new_tokens=60, ignore_eos=True, num_draft_tokens=3)
    undisturbed = [r async for r in servicer._run(request, PausedContext())]
    stream = servicer._run(request, PausedContext())
    first = await anext(stream)                 # then the client reads nothing: the generator waits at its yield
    await asyncio.sleep(2 * LEASE_S + 0.5)      # the services' reapers run every LEASE_S / 4 meanwhile
    assert len(verifier.engine.sessions) == 1 and len(draft.engine.sessions) == 1    # still held
    paused = [first] + [r async for r in stream]
    ids = [[t for r in responses for t in r.token_ids] for responses in (undisturbed, paused)]
    assert len(ids[0]) == 60 and ids[1] == ids[0]
    assert "".join(r.text for r in paused) == "".join(r.text for r in undisturbed)
    assert expired(verifier) == 0 and expired(draft) == 0


async def test_keepalive_never_creates_a_draft_session(leased) -> None:
    _, _, draft = leased
    async with grpc.aio.insecure_channel(draft.addr) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await draft_pb2_grpc.DraftStub(channel).KeepAlive(
                common_pb2.KeepAliveRequest(session_id="nobody", owner_token="t"), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "nobody" not in draft.engine.sessions


SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]   # the client's flow control


async def test_a_grpc_client_that_stops_reading_gets_its_whole_output(leased) -> None:
    """Over real gRPC: with a small flow-control window the gateway's writes wait and its rounds stop (about 32
    tokens in) while the client reads nothing for twice the lease; then it reads the rest."""
    servicer, verifier, draft = leased
    gateway = await start_gateway(verifier.addr, draft.addr)
    prompt_len = len(servicer.tokenizer(PROMPT)["input_ids"])
    request = client.make_request(PROMPT, max_new_tokens=200, ignore_eos=True, num_draft_tokens=3)
    try:
        async with grpc.aio.insecure_channel(gateway.addr, options=SMALL_WINDOW) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            undisturbed = [t async for r in stub.Generate(request, timeout=120) for t in r.token_ids]
            call = stub.Generate(request, timeout=120)
            paused = list((await call.read()).token_ids)
            await asyncio.sleep(2 * LEASE_S + 0.5)
            held = [len(s.seq.token_ids) for s in verifier.engine.sessions.values()]
            while (response := await call.read()) != grpc.aio.EOF:
                paused.extend(response.token_ids)
        assert len(undisturbed) == 200 and paused == undisturbed
        assert len(held) == 1 and held[0] < prompt_len + 200       # paused mid-stream, its session still open
        assert expired(verifier) == 0 and expired(draft) == 0
    finally:
        await gateway.stop()
