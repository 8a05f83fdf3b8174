"""Sessions are owned and leased; internal RPCs are bounded and typed. Real gRPC servers, tiny models.

- Only the caller holding a session's owner token can Verify / Propose / End it (PERMISSION_DENIED otherwise).
- Drafts per Verify are capped; session ids are bounded; undecodable bytes are INVALID_ARGUMENT on every method.
- A session left idle for the lease is ended on both model services and every KV block comes back, also when the
  gateway that opened it is SIGKILLed mid-stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from draft_service.server import build_draft
from gateway.proposers.draft_model import ModelDrafter
from protos.specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc, generate_pb2, verifier_pb2, verifier_pb2_grpc
from specmesh.config import DraftConfig, EngineConfig, VerifierConfig
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from specmesh.ops.launcher import wait_serving
from specmesh.rpc.grpc_server import ServiceServer
from specmesh.spec.sampling import SamplingParams
from tests.stack import Running, reference_greedy, start_draft, start_gateway, start_verifier
from tests.test_faults import free_port
from verifier_service.server import build_verifier

PROMPT = "Once upon a time, in a city on a high valley,"
DENIED = grpc.StatusCode.PERMISSION_DENIED
INVALID = grpc.StatusCode.INVALID_ARGUMENT
LEASE_S = 1.0


async def start_leased(lease_s: float) -> tuple[Running, Running]:
    """Verifier and draft service with a short session lease."""
    engine = EngineConfig(model="tiny-target", kv_cache_memory_mb=16, max_model_len=512)
    v_server, v_engine = build_verifier(VerifierConfig(port=0, session_lease_s=lease_s, engine=engine))
    verifier = Running(v_server, await v_server.start("127.0.0.1", 0), v_engine)
    d_server, d_engine = build_draft(DraftConfig(port=0, session_lease_s=lease_s,
                                                 engine=dataclasses.replace(engine, model="tiny-draft")))
    return verifier, Running(d_server, await d_server.start("127.0.0.1", 0), d_engine)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack():
    verifier = await start_verifier(max_model_len=512)
    draft = await start_draft()
    gateway = await start_gateway(verifier.addr, draft.addr)
    yield {"gateway": gateway, "verifier": verifier, "draft": draft}
    for running in (gateway, draft, verifier):
        await running.stop()


async def code_of(call) -> grpc.StatusCode:  # noqa: ANN001 - an awaitable gRPC call
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        assert exc.details(), "every error carries a message"
        return exc.code()
    return grpc.StatusCode.OK


def expired_count(running: Running) -> float:
    return running.engine.metrics.registry.get_sample_value("specmesh_sessions_expired_total") or 0.0


async def wait_released(running: Running, timeout_s: float) -> None:
    """Until the engine holds no session and every KV block is free."""
    engine = running.engine
    for _ in range(int(timeout_s / 0.05)):
        if not engine.sessions and engine.block_manager.num_used_blocks == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"sessions {list(engine.sessions)}, {engine.block_manager.num_used_blocks} blocks used")


# ---- ownership ------------------------------------------------------------------------------------------------


async def test_verifier_session_needs_its_owner_token(stack) -> None:
    async with grpc.aio.insecure_channel(stack["verifier"].addr) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        start = await stub.StartSession(verifier_pb2.StartSessionRequest(session_id="owned", prompt_token_ids=[5, 6]))
        token = start.owner_token
        assert len(token) >= 20
        for wrong in ("", "guess", token[:-1]):
            verify = verifier_pb2.VerifyRequest(session_id="owned", draft_token_ids=[1], owner_token=wrong)
            assert await code_of(stub.Verify(verify)) == DENIED
            end = common_pb2.EndSessionRequest(session_id="owned", owner_token=wrong)
            assert await code_of(stub.EndSession(end)) == DENIED
        assert "owned" in stack["verifier"].engine.sessions                     # nothing above touched it
        ok = await stub.Verify(verifier_pb2.VerifyRequest(session_id="owned", draft_token_ids=[1], owner_token=token))
        assert len(ok.token_ids) >= ok.num_accepted + 1
        # Reopening an open session id cannot take it over.
        again = verifier_pb2.StartSessionRequest(session_id="owned", prompt_token_ids=[5])
        assert await code_of(stub.StartSession(again)) == grpc.StatusCode.ALREADY_EXISTS
        await stub.EndSession(common_pb2.EndSessionRequest(session_id="owned", owner_token=token))
        verify = verifier_pb2.VerifyRequest(session_id="owned", draft_token_ids=[1], owner_token=token)
        assert await code_of(stub.Verify(verify)) == DENIED                        # ended: the token opens nothing
    await wait_released(stack["verifier"], 10)


async def test_draft_session_needs_the_token_that_created_it(stack) -> None:
    async with grpc.aio.insecure_channel(stack["draft"].addr) as channel:
        stub = draft_pb2_grpc.DraftStub(channel)

        def propose(token: str, context: list[int]) -> draft_pb2.ProposeRequest:
            return draft_pb2.ProposeRequest(session_id="drafted", owner_token=token, context_len=len(context),
                                            new_token_ids=context, num_draft_tokens=2)

        assert await code_of(stub.Propose(propose("", [1, 2, 3]))) == INVALID             # a token is required
        first = await stub.Propose(propose("mine", [1, 2, 3]))
        assert len(first.draft_token_ids) == 2
        assert await code_of(stub.Propose(propose("theirs", [1, 2, 3]))) == DENIED
        end = common_pb2.EndSessionRequest(session_id="drafted", owner_token="theirs")
        assert await code_of(stub.EndSession(end)) == DENIED
        assert "drafted" in stack["draft"].engine.sessions
        again = await stub.Propose(propose("mine", [1, 2, 3]))
        assert list(again.draft_token_ids) == list(first.draft_token_ids)
        await stub.EndSession(common_pb2.EndSessionRequest(session_id="drafted", owner_token="mine"))
    await wait_released(stack["draft"], 10)


async def test_other_caller_cannot_drive_a_running_generation(stack) -> None:
    """A stream runs through the gateway; a second caller that learns its session id gets PERMISSION_DENIED
    everywhere, and the stream's output is untouched."""
    verifier, draft = stack["verifier"], stack["draft"]
    request = client.make_request(PROMPT, max_new_tokens=480, ignore_eos=True, num_draft_tokens=3)
    stream = asyncio.ensure_future(_collect(stack["gateway"].addr, request))
    for _ in range(400):
        if verifier.engine.sessions and draft.engine.sessions:
            break
        await asyncio.sleep(0.01)
    session_id = next(iter(verifier.engine.sessions))
    async with grpc.aio.insecure_channel(verifier.addr) as v_channel, \
            grpc.aio.insecure_channel(draft.addr) as d_channel:
        v_stub, d_stub = verifier_pb2_grpc.VerifierStub(v_channel), draft_pb2_grpc.DraftStub(d_channel)
        verify = verifier_pb2.VerifyRequest(session_id=session_id, draft_token_ids=[1, 2], owner_token="x")
        end = common_pb2.EndSessionRequest(session_id=session_id)
        propose = draft_pb2.ProposeRequest(session_id=session_id, owner_token="x", context_len=1, new_token_ids=[1],
                                           num_draft_tokens=2)
        codes = [await code_of(v_stub.Verify(verify)), await code_of(v_stub.EndSession(end)),
                 await code_of(d_stub.Propose(propose)), await code_of(d_stub.EndSession(end))]
    assert not stream.done(), "the generation ended before the other caller tried"
    assert codes == [DENIED] * 4
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    assert await stream == reference_greedy(tok(PROMPT)["input_ids"], 480)
    await wait_released(verifier, 10)
    await wait_released(draft, 10)


async def _collect(addr: str, request: generate_pb2.GenerateRequest) -> list[int]:
    return [t async for r in client.stream(addr, request, timeout_s=120) for t in r.token_ids]


# ---- bounds and parsing ---------------------------------------------------------------------------------------


async def test_verify_over_the_draft_cap_is_invalid_argument(stack) -> None:
    async with grpc.aio.insecure_channel(stack["verifier"].addr) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        start = await stub.StartSession(verifier_pb2.StartSessionRequest(session_id="cap", prompt_token_ids=[5]))
        for n in (65, 512, 4096):
            request = verifier_pb2.VerifyRequest(session_id="cap", draft_token_ids=[1] * n,
                                                 owner_token=start.owner_token)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Verify(request, timeout=30)
            assert info.value.code() == INVALID and "max_draft_tokens = 64" in info.value.details()
        ok = await stub.Verify(verifier_pb2.VerifyRequest(session_id="cap", draft_token_ids=[1] * 64,
                                                          owner_token=start.owner_token), timeout=30)
        assert len(ok.token_ids) >= ok.num_accepted + 1                   # the cap itself is fine; session usable
        await stub.EndSession(common_pb2.EndSessionRequest(session_id="cap", owner_token=start.owner_token))
    await wait_released(stack["verifier"], 10)


HUGE_ID = "s" * 2**20


async def test_huge_session_ids_are_invalid_argument(stack) -> None:
    async with grpc.aio.insecure_channel(stack["verifier"].addr) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        calls = [stub.StartSession(verifier_pb2.StartSessionRequest(session_id=HUGE_ID, prompt_token_ids=[5])),
                 stub.Verify(verifier_pb2.VerifyRequest(session_id=HUGE_ID, owner_token="t")),
                 stub.EndSession(common_pb2.EndSessionRequest(session_id=HUGE_ID, owner_token="t"))]
        assert [await code_of(c) for c in calls] == [INVALID] * 3
    async with grpc.aio.insecure_channel(stack["draft"].addr) as channel:
        stub = draft_pb2_grpc.DraftStub(channel)
        calls = [stub.Propose(draft_pb2.ProposeRequest(session_id=HUGE_ID, owner_token="t", context_len=1,
                                                       new_token_ids=[1], num_draft_tokens=1)),
                 stub.EndSession(common_pb2.EndSessionRequest(session_id=HUGE_ID, owner_token="t"))]
        assert [await code_of(c) for c in calls] == [INVALID] * 2
    request = generate_pb2.GenerateRequest(prompt="hi", request_id=HUGE_ID)     # the gateway's session id
    assert await code_of(_collect(stack["gateway"].addr, request)) == INVALID
    assert not stack["verifier"].engine.sessions and not stack["draft"].engine.sessions


async def test_longest_request_id_still_fits_the_session_id_bound(stack) -> None:
    """128 four-byte characters (the gateway's request_id limit) make a valid session id on both services."""
    request = client.make_request("hi", max_new_tokens=6, ignore_eos=True, num_draft_tokens=2)
    request.request_id = "\U0001F600" * 128
    responses = [r async for r in client.stream(stack["gateway"].addr, request, timeout_s=60)]
    assert sum(len(r.token_ids) for r in responses) == 6 and responses[0].request_id == request.request_id


NOT_UTF8 = bytes([0x0A, 0x03, 0xFF, 0xFE, 0xC3])      # field 1 (a string on these methods) = invalid UTF-8
TRUNCATED = b"\x0a\xff\xff\xff\x0f"                   # field 1 claims ~4 GB that never come
METHODS = {
    "verifier": [("/specmesh.v1.Verifier/StartSession", True), ("/specmesh.v1.Verifier/Verify", True),
                 ("/specmesh.v1.Verifier/EndSession", True), ("/specmesh.v1.Verifier/GetModelInfo", False),
                 ("/grpc.health.v1.Health/Check", True)],
    "draft": [("/specmesh.v1.Draft/Propose", True), ("/specmesh.v1.Draft/EndSession", True)],
    "gateway": [("/specmesh.v1.Generation/Complete", True), ("/specmesh.v1.Generation/Generate", True)],
}
CASES = [(service, method, payload) for service, methods in METHODS.items() for method, has_string in methods
         for payload in ([NOT_UTF8, TRUNCATED] if has_string else [TRUNCATED])]


@pytest.mark.parametrize(("service", "method", "payload"), CASES,
                         ids=[f"{m.rsplit('/', 1)[1]}-{'utf8' if p == NOT_UTF8 else 'trunc'}" for _, m, p in CASES])
async def test_undecodable_bytes_are_invalid_argument_everywhere(stack, service: str, method: str,
                                                                 payload: bytes) -> None:
    async with grpc.aio.insecure_channel(stack[service].addr) as channel:
        if method.endswith("/Generate"):
            call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
            code = await code_of(_drain(call(payload, timeout=30)))
        else:
            call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(payload, timeout=30)
            code = info.value.code()
            assert "not a valid" in info.value.details()
    assert code == INVALID


async def _drain(call) -> None:  # noqa: ANN001 - a server-streaming call
    async for _ in call:
        pass


# ---- leases ---------------------------------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def leased():
    verifier, draft = await start_leased(LEASE_S)
    yield verifier, draft
    for running in (draft, verifier):
        await running.stop()


async def test_idle_sessions_expire_on_both_services(leased) -> None:
    verifier, draft = leased
    async with grpc.aio.insecure_channel(verifier.addr) as v_channel, \
            grpc.aio.insecure_channel(draft.addr) as d_channel:
        v_stub, d_stub = verifier_pb2_grpc.VerifierStub(v_channel), draft_pb2_grpc.DraftStub(d_channel)
        prompt = list(range(3, 40))
        idle = await v_stub.StartSession(verifier_pb2.StartSessionRequest(session_id="idle", prompt_token_ids=prompt))
        busy = await v_stub.StartSession(verifier_pb2.StartSessionRequest(session_id="busy", prompt_token_ids=prompt))
        await d_stub.Propose(draft_pb2.ProposeRequest(session_id="idle", owner_token="t", context_len=len(prompt),
                                                      new_token_ids=prompt, num_draft_tokens=3))
        assert verifier.engine.block_manager.num_used_blocks > 0 and draft.engine.block_manager.num_used_blocks > 0
        # "busy" keeps calling every LEASE_S / 10 while "idle" runs out: only idle time expires a session.
        loop = asyncio.get_running_loop()
        until = loop.time() + 3 * LEASE_S
        while loop.time() < until:
            await v_stub.Verify(verifier_pb2.VerifyRequest(session_id="busy", owner_token=busy.owner_token))
            await asyncio.sleep(LEASE_S / 10)
        assert list(verifier.engine.sessions) == ["busy"] and not draft.engine.sessions
        verify = verifier_pb2.VerifyRequest(session_id="idle", owner_token=idle.owner_token)
        assert await code_of(v_stub.Verify(verify)) == DENIED              # expired: the token opens nothing
    await wait_released(verifier, 5 * LEASE_S)                             # "busy" expires too once the caller left
    await wait_released(draft, 5 * LEASE_S)
    assert expired_count(verifier) == 2 and expired_count(draft) == 1


async def test_drafter_reopens_a_draft_session_whose_lease_ran_out(leased) -> None:
    """Other tiers may draft for longer than the lease: the draft service answers NOT_FOUND to the next partial
    context (the expired lease binds nothing), and the drafter resends its whole context at once."""
    _, draft = leased
    async with grpc.aio.insecure_channel(draft.addr) as channel:
        drafter = ModelDrafter(draft_pb2_grpc.DraftStub(channel), "reopened", SamplingParams(), timeout_s=30.0)
        context = list(range(3, 30))
        first = await drafter.propose(context, 3)
        await wait_released(draft, 5 * LEASE_S)                               # the lease ran out
        assert expired_count(draft) == 1
        again = await drafter.propose(context + first.token_ids, 3)
        assert len(again.token_ids) == 3 and drafter.num_failures == 0
        await drafter.close()
    await wait_released(draft, 10)


class SlowDraft(draft_pb2_grpc.DraftServicer):
    """A draft service whose Propose takes longer than the verifier's lease."""

    async def Propose(self, request: draft_pb2.ProposeRequest,
                      context: grpc.aio.ServicerContext) -> draft_pb2.ProposeResponse:
        await asyncio.sleep(3 * LEASE_S)
        return draft_pb2.ProposeResponse()


async def test_round_slower_than_the_lease_keeps_its_session(leased) -> None:
    """The gateway renews the verifier session's lease while a round waits (gateway/keepalive.py): a draft call
    slower than the lease (this draft service does not even know KeepAlive) costs time, not the generation."""
    verifier, _ = leased
    slow = ServiceServer(["specmesh.v1.Draft"], lambda s: draft_pb2_grpc.add_DraftServicer_to_server(SlowDraft(), s))
    slow_port = await slow.start("127.0.0.1", 0)
    gateway = await start_gateway(verifier.addr, f"127.0.0.1:{slow_port}", draft_timeout_s=10.0)
    try:
        request = client.make_request(PROMPT, max_new_tokens=2, ignore_eos=True, num_draft_tokens=3)
        tokens = await _collect(gateway.addr, request)
        prompt_ids = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))(PROMPT)["input_ids"]
        assert tokens == reference_greedy(prompt_ids, 2)
        assert expired_count(verifier) == 0
        await wait_released(verifier, 5 * LEASE_S)
    finally:
        await gateway.stop()
        await slow.stop(0)


async def test_sessions_of_a_sigkilled_gateway_expire(leased) -> None:
    verifier, draft = leased
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--port", str(port), "--verifier-addr", verifier.addr,
         "--draft-addr", draft.addr, "--enable-cache", "0", "--enable-ngram", "0", "--http-port", "0"],
        env={**os.environ}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.to_thread(wait_serving, f"127.0.0.1:{port}", 120, gateway)
        request = client.make_request(PROMPT, max_new_tokens=480, ignore_eos=True, num_draft_tokens=3)
        # The first stream alone, so that it makes a draft prefill (beside others a draft prefill is made only where a
        # model round could pay under their load: with three streams starting together, by timing, none may be);
        # then two more. Kill only once every session has its first token: a StartSession still in flight when the
        # gateway dies is cancelled, and a cancelled StartSession closes its session at once (no lease to expire).
        # The same holds for the Propose that opened the draft session (the draft prefill, sent after the verifier's
        # and not awaited by the stream): wait until it was answered (its context computed, the session no longer
        # busy) before the kill.
        streams = [asyncio.ensure_future(_status_of_stream(f"127.0.0.1:{port}", request))]
        await _until(lambda: any(s.seq.num_computed > 0 and not s.busy for s in list(draft.engine.sessions.values())),
                     30.0)
        streams += [asyncio.ensure_future(_status_of_stream(f"127.0.0.1:{port}", request)) for _ in range(2)]
        await _until(lambda: len(verifier.engine.sessions) == 3
                     and all(s.started for s in verifier.engine.sessions.values()), 30.0)
        assert draft.engine.sessions, "the first stream's draft session is open when the gateway dies"
        gateway.send_signal(signal.SIGKILL)
        gateway.wait()
        codes = await asyncio.gather(*streams)
        assert all(c == grpc.StatusCode.UNAVAILABLE for c in codes), codes
        await wait_released(verifier, 6 * LEASE_S + 4)
        await wait_released(draft, 6 * LEASE_S + 4)
        assert expired_count(verifier) == 3 and expired_count(draft) >= 1
    finally:
        gateway.kill()
        gateway.wait()


async def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _status_of_stream(addr: str, request: generate_pb2.GenerateRequest) -> grpc.StatusCode:
    try:
        async for _ in client.stream(addr, request, timeout_s=120):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
