"""Faults with real processes: draft killed mid-stream, verifier killed, SIGTERM drains. Nothing lost or leaked."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from protos.specmesh.v1 import common_pb2, generate_pb2_grpc
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from specmesh.ops.launcher import wait_serving
from tests.stack import reference_greedy, start_gateway, start_verifier
from tests.test_e2e_greedy import wait_blocks_free

PROMPT = "Once upon a time, in a city on a high valley,"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def spawn(module: str, service: str, port: int, model: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, f"SPECMESH_{service}_PORT": str(port), f"SPECMESH_{service}_MODEL": model,
           f"SPECMESH_{service}_KV_CACHE_MEMORY_MB": "16"}
    proc = subprocess.Popen([sys.executable, "-m", module], env=env, stdout=subprocess.DEVNULL)
    await asyncio.to_thread(wait_serving, f"127.0.0.1:{port}", 120, proc)
    return proc


@pytest.fixture(scope="module")
def expected() -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    return reference_greedy(tok(PROMPT)["input_ids"], 300)


async def stream_ids(addr: str, n: int, on_first=None) -> tuple[list[int], list]:
    responses = []
    async for r in client.stream(addr, client.make_request(PROMPT, max_new_tokens=n, ignore_eos=True,
                                                           num_draft_tokens=3), timeout_s=120):
        responses.append(r)
        if on_first is not None and len(responses) == 2:
            on_first()
    return [t for r in responses for t in r.token_ids], responses


def model_rounds(responses: list) -> int:
    return sum(r.round.draft_source == common_pb2.DRAFT_SOURCE_MODEL and r.round.num_drafted > 0 for r in responses)


@pytest.mark.parametrize("suffix_drafting", [False, True], ids=["tiers", "suffix"])
async def test_draft_killed_mid_stream_then_restarted(expected, suffix_drafting: bool) -> None:
    """Both drafting paths: the tiers' (the whole context resent inside a round) and the shipped suffix drafting's
    (resent in the background after the backoff, ProposerSet.resend_context; a resend to a dead service backs off)."""
    port = free_port()
    draft = await spawn("draft_service", "DRAFT", port, "tiny-draft")
    verifier = await start_verifier(decode_ahead_tokens=8)
    gateway = await start_gateway(verifier.addr, f"127.0.0.1:{port}", draft_timeout_s=2.0,
                                  suffix_drafting=suffix_drafting)
    try:
        ids, responses = await stream_ids(gateway.addr, 300, on_first=draft.kill)
        assert ids == expected                                    # identical output across the failure
        assert responses[-1].usage.num_drafted_tokens < 300       # some rounds ran target-only
        draft.wait()
        ids, responses = await stream_ids(gateway.addr, 40)       # new requests keep working without it
        assert ids == expected[:40] and model_rounds(responses) == 0
        draft = await spawn("draft_service", "DRAFT", port, "tiny-draft")
        for _ in range(40):                                       # reconnects within a few seconds
            ids, responses = await stream_ids(gateway.addr, 40)
            assert ids == expected[:40]
            if model_rounds(responses) > 0:
                break
            await asyncio.sleep(0.5)
        assert model_rounds(responses) > 0                        # the draft service is used again
    finally:
        draft.kill()
        await gateway.stop()
        await verifier.stop()


async def test_verifier_killed_mid_stream_ends_with_unavailable() -> None:
    port = free_port()
    verifier = await spawn("verifier_service", "VERIFIER", port, "tiny-target")
    gateway = await start_gateway(f"127.0.0.1:{port}", "")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(stream_ids(gateway.addr, 900, on_first=verifier.kill), 60)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "verifier" in info.value.details()
    finally:
        verifier.kill()
        await gateway.stop()


async def test_sigterm_drains_in_flight_streams_and_exits_zero(expected) -> None:
    port = free_port()
    verifier = await spawn("verifier_service", "VERIFIER", port, "tiny-target")
    gateway = await start_gateway(f"127.0.0.1:{port}", "")
    try:
        task = asyncio.ensure_future(stream_ids(gateway.addr, 300, on_first=lambda: verifier.send_signal(
            signal.SIGTERM)))
        while verifier.poll() is None and not task.done():
            await asyncio.sleep(0.02)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                            timeout=1)
                except grpc.aio.AioRpcError:
                    continue
                if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
        else:
            pytest.fail("health never reported NOT_SERVING while draining")
        with pytest.raises(grpc.aio.AioRpcError) as info:                # new work is refused while draining
            async with grpc.aio.insecure_channel(gateway.addr) as channel:
                async for _ in generate_pb2_grpc.GenerationStub(channel).Generate(
                        client.make_request("new", max_new_tokens=5), timeout=30):
                    pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        ids, _ = await task                                              # the running stream finishes whole
        assert ids == expected
        assert await asyncio.to_thread(verifier.wait, 30) == 0
    finally:
        verifier.kill()
        await gateway.stop()


async def test_gateway_starts_sessions_on_another_replica(expected) -> None:
    """A replica that is down or draining answers UNAVAILABLE before any token: the request moves on."""
    down = await start_verifier()
    draining = await start_verifier()
    healthy = await start_verifier()
    gateway = await start_gateway(f"{down.addr},{draining.addr},{healthy.addr}", "")
    try:
        await down.stop()
        draining.engine.draining = True
        for _ in range(4):                                   # every round-robin starting point
            ids, _ = await stream_ids(gateway.addr, 20)
            assert ids == expected[:20]
        await wait_blocks_free(healthy)                      # sessions were ended on the replica that served them
        assert not draining.engine.sessions
    finally:
        for running in (gateway, draining, healthy):
            await running.stop()
