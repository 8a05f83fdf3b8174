"""Abuse scenarios of a soak run (bench/soak.py), run one after another once the mixed traffic has stopped; each
returns what it saw and the reasons it failed (empty = pass). Public interfaces only (gRPC, health, SIGSTOP).

- pinning: one tenant (key soak-pin, `streams` limit PIN_LIMIT) opens more streams than its limit that read only
  their first response; the ones over the limit must be RESOURCE_EXHAUSTED with grpc-retry-pushback-ms while
  another tenant (soak-victim) is still served.
- overload: a burst of --overload-streams short requests at once: only OK or RESOURCE_EXHAUSTED / UNAVAILABLE
  (each with the retry hint), never INTERNAL / UNKNOWN.
- hung verifier: the verifier is SIGSTOPped for --hang-s while streams with a short deadline run: the gateway must
  report NOT_SERVING within its documented bound, and once the verifier resumes the sessions must be freed by the
  gateway's retried EndSession, sooner than the lease would.
- slow reader: a greedy stream that reads nothing for twice the lease, then reads, must give exactly the output of
  the same request read at once, and no session may expire meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.soak_report import metric_value
from bench.soak_services import SoakServices
from bench.soak_traffic import METADATA, TRAFFIC_KEY
from gateway.quotas import PUSHBACK_KEY
from protos.specmesh.v1 import generate_pb2_grpc
from specmesh.ops import client

PIN_LIMIT = 3
API_KEYS = f"{TRAFFIC_KEY}:soak,soak-pin:pinner:streams={PIN_LIMIT},soak-victim:victim"
SCENARIOS = ("pinning", "overload", "hung", "slow")
HEALTH_DOWN_BOUND_S = 6.0          # failures x (interval + timeout) with the gateway's defaults (README)
# A client's small HTTP/2 window: a stream that does not read then really stops its rounds (backpressure); with
# the default window the tiny model's whole output fits in the transport's buffers.
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


def key(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {name}"),)


def pushback(exc: grpc.aio.AioRpcError) -> bool:
    return any(k == PUSHBACK_KEY for k, _ in exc.trailing_metadata() or ())


async def first_then_hold(stub: generate_pb2_grpc.GenerationStub, request: object, metadata: tuple,
                          hold: asyncio.Event) -> tuple[str, bool]:
    """Opens a stream, reads its first response, then nothing until `hold` is set; (code, had pushback)."""
    call = stub.Generate(request, metadata=metadata, timeout=300)
    try:
        await call.read()
        await hold.wait()
        return "OK", False
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, pushback(exc)
    finally:
        call.cancel()


async def pinning(services: SoakServices, args: Any) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(services.gateway_addr, options=SMALL_WINDOW) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        hold = asyncio.Event()
        request = client.make_request("Once upon a time", max_new_tokens=args.max_model_len // 2, ignore_eos=True)
        pinned = [asyncio.ensure_future(first_then_hold(stub, request, key("soak-pin"), hold))
                  for _ in range(PIN_LIMIT + 3)]
        await asyncio.sleep(1.0)
        refused = [t.result() for t in pinned if t.done()]
        try:
            victim = await stub.Complete(client.make_request("The quick brown fox", max_new_tokens=8),
                                         metadata=key("soak-victim"), timeout=60)
            victim_code = "OK" if victim.token_ids else "EMPTY"
        except grpc.aio.AioRpcError as exc:
            victim_code = exc.code().name
        hold.set()
        await asyncio.gather(*pinned)
    codes = Counter(code for code, _ in refused)
    failures = []
    if codes.get("RESOURCE_EXHAUSTED", 0) < 1:
        failures.append(f"pinning: no stream over the tenant's limit was refused ({dict(codes)})")
    if not all(hint for code, hint in refused if code == "RESOURCE_EXHAUSTED"):
        failures.append("pinning: a RESOURCE_EXHAUSTED without grpc-retry-pushback-ms")
    if victim_code != "OK":
        failures.append(f"pinning: the other tenant got {victim_code}")
    return {"streams": len(pinned), "limit": PIN_LIMIT, "refused_at_once": dict(codes), "victim": victim_code,
            "failures": failures}


async def overload(services: SoakServices, args: Any) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(services.gateway_addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> tuple[str, bool]:
            try:
                await stub.Complete(client.make_request(f"Request {i}: the", max_new_tokens=8, ignore_eos=True),
                                    metadata=METADATA, timeout=120)
                return "OK", False
            except grpc.aio.AioRpcError as exc:
                return exc.code().name, pushback(exc)

        results = await asyncio.gather(*(one(i) for i in range(args.overload_streams)))
    codes = Counter(code for code, _ in results)
    failures = [f"overload: {n} x {code}" for code, n in codes.items()
                if code not in ("OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE")]
    if not all(hint for code, hint in results if code in ("RESOURCE_EXHAUSTED", "UNAVAILABLE")):
        failures.append("overload: a refusal without grpc-retry-pushback-ms")
    return {"streams": args.overload_streams, "outcomes": dict(codes), "failures": failures}


async def gateway_serving(addr: str) -> bool:
    async with grpc.aio.insecure_channel(addr) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def hung_verifier(services: SoakServices, args: Any) -> dict[str, Any]:
    pid = services.stack.procs["verifier"].pid
    expired_before = metric_value(services.metrics_text("verifier"), "specmesh_sessions_expired_total") or 0.0
    async with grpc.aio.insecure_channel(services.gateway_addr, options=SMALL_WINDOW) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = client.make_request("def fibonacci(n):", max_new_tokens=args.max_model_len // 2, ignore_eos=True)
        streams = [asyncio.ensure_future(first_then_hold(stub, request, METADATA, asyncio.Event())) for _ in range(2)]
        await asyncio.sleep(1.0)                      # both hold a verifier session now (paused: small window)
        held_at_stop = (await services.verifier_info()).num_sessions
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        down_s = None
        try:
            while time.monotonic() - stopped < args.hang_s:
                if down_s is None and not await gateway_serving(services.gateway_addr):
                    down_s = time.monotonic() - stopped
                await asyncio.sleep(0.2)
            for task in streams:
                task.cancel()                         # the clients leave while the verifier is hung
            await asyncio.gather(*streams, return_exceptions=True)
        finally:
            os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    released_s = None
    while time.monotonic() - resumed < args.lease_s + 5:
        info = await services.verifier_info()
        if info.num_sessions == 0:
            released_s = time.monotonic() - resumed
            break
        await asyncio.sleep(0.2)
    # A hang longer than the lease may let the verifier's reaper end a session at once on resume (fine: it is the
    # lease doing its job); reported so the soak's expiry check can tell it from an abandoned session.
    expired = (metric_value(services.metrics_text("verifier"), "specmesh_sessions_expired_total") or 0.0)
    failures = [] if held_at_stop else ["hung verifier: no session was held when the verifier stopped"]
    if args.hang_s > HEALTH_DOWN_BOUND_S + 1 and (down_s is None or down_s > HEALTH_DOWN_BOUND_S + 1):
        failures.append(f"hung verifier: NOT_SERVING after {down_s} s (documented: {HEALTH_DOWN_BOUND_S} s)")
    if released_s is None or released_s >= args.lease_s:
        failures.append(f"hung verifier: sessions freed {released_s} s after it resumed (lease {args.lease_s} s)")
    return {"hang_s": args.hang_s, "sessions_at_stop": held_at_stop,
            "not_serving_after_s": None if down_s is None else round(down_s, 1),
            "sessions_freed_after_resume_s": None if released_s is None else round(released_s, 1),
            "sessions_expired": int(expired - expired_before), "failures": failures}


async def slow_reader(services: SoakServices, args: Any) -> dict[str, Any]:
    request = client.make_request("def fibonacci(n):", max_new_tokens=160, ignore_eos=True, num_draft_tokens=4)
    expired_before = metric_value(services.metrics_text("verifier"), "specmesh_sessions_expired_total") or 0.0
    async with grpc.aio.insecure_channel(services.gateway_addr, options=SMALL_WINDOW) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        undisturbed = [t async for r in stub.Generate(request, metadata=METADATA, timeout=120) for t in r.token_ids]
        call = stub.Generate(request, metadata=METADATA, timeout=120 + 2 * args.lease_s)
        try:
            paused = list((await call.read()).token_ids)
            await asyncio.sleep(2 * args.lease_s)              # reads nothing (its stream's rounds stop)
            while (response := await call.read()) != grpc.aio.EOF:
                paused.extend(response.token_ids)
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            paused, code = [], exc.code().name
    expired = (metric_value(services.metrics_text("verifier"), "specmesh_sessions_expired_total") or 0.0)
    failures = []
    if code != "OK" or paused != undisturbed:
        failures.append(f"slow reader: {code}, {len(paused)} tokens vs {len(undisturbed)} undisturbed"
                        + ("" if code != "OK" else " (different)"))
    if expired > expired_before:
        failures.append(f"slow reader: {expired - expired_before:.0f} verifier session(s) expired meanwhile")
    return {"paused_s": 2 * args.lease_s, "code": code, "identical": paused == undisturbed,
            "tokens": len(paused), "failures": failures}


RUNNERS = {"pinning": pinning, "overload": overload, "hung": hung_verifier, "slow": slow_reader}


async def run_scenarios(services: SoakServices, args: Any, names: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        out[name] = await RUNNERS[name](services, args)
    return out
