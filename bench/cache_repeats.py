"""Repeated traffic with the draft cache off and on, in one run: speedup, acceptance, draft-link bytes per token.

    python -m bench.cache_repeats --preset tiny                       # ~1 min
    python -m bench.cache_repeats --preset qwen --max-new-tokens 48 --modes off,cache
    python -m bench.cache_repeats --preset tiny --rtt-ms 40 --redis-url redis://127.0.0.1:56379/0

The FAQ prompts of the workload (category `repeated`, each asked `repeat` = 8 times) go, greedy, to one gateway
per mode; all gateways share one verifier and one draft service (in this process, engines on their own threads).
Each gateway reaches the draft service through its own loopback WAN proxy (bench/wan_proxy.py), which counts
the bytes on the wire and can add latency. Modes:
  off    draft service only (cache and n-gram tiers disabled)
  ngram  n-gram prompt lookup, then the draft service
  cache  draft cache (in-process, or Redis with --redis-url), then the draft service
  all    cache, n-gram, draft service (the gateway's defaults)
Every mode uses one tenant for the run, so the cache warms on the first ask; "warm" rows cover asks 2..N.
All outputs of one FAQ must be identical across modes and asks (greedy); a mismatch exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    Prompt,
    RequestResult,
    add_workload_args,
    aggregate,
    format_sources,
    load_workload,
    log,
    make_request,
    result_paths,
    run_metadata,
    split_arg,
    timed_request,
    write_json,
)
from bench.wan_proxy import WanProxy
from draft_service.server import build_draft
from gateway.server import build_gateway
from specmesh.config import DraftConfig, EngineConfig, GatewayConfig, VerifierConfig
from specmesh.ops.launcher import PRESETS
from specmesh.rpc.grpc_server import ServiceServer
from verifier_service.server import build_verifier

MODES = {"off": dict(enable_cache=False, enable_ngram=False), "ngram": dict(enable_cache=False, enable_ngram=True),
         "cache": dict(enable_cache=True, enable_ngram=False), "all": dict(enable_cache=True, enable_ngram=True)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--modes", default="off,cache,all", help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--asks", type=int, default=0, help="times each FAQ is asked (0 = the workload's repeat)")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip latency added to the draft link")
    p.add_argument("--redis-url", default="", help="cache in this Redis instead of in-process")
    p.add_argument("--threads", type=int, default=1, help="torch threads per model engine")
    p.add_argument("--name", default="")
    args = p.parse_args(argv)
    args.categories = args.categories or "repeated"
    return args


class Bench:
    """Verifier, draft service, and per mode: a WAN proxy to the draft service and a gateway."""

    def __init__(self, args: argparse.Namespace, modes: list[str]) -> None:
        self.args, self.modes = args, modes
        self.servers: list[tuple[ServiceServer, Any]] = []
        self.proxies: dict[str, WanProxy] = {}
        self.gateways: dict[str, tuple[ServiceServer, str]] = {}

    async def start(self) -> None:
        target, draft = PRESETS[self.args.preset]
        engine = EngineConfig(num_threads=self.args.threads)
        verifier, v_engine = build_verifier(VerifierConfig(engine=dataclasses.replace(engine, model=target)))
        drafter, d_engine = build_draft(DraftConfig(engine=dataclasses.replace(engine, model=draft)))
        v_port, d_port = await verifier.start("127.0.0.1", 0), await drafter.start("127.0.0.1", 0)
        self.servers += [(verifier, v_engine), (drafter, d_engine)]
        for mode in self.modes:
            proxy = self.proxies[mode] = await WanProxy(0, f"127.0.0.1:{d_port}", self.args.rtt_ms / 2).start()
            config = GatewayConfig(port=0, verifier_addr=f"127.0.0.1:{v_port}", draft_addr=proxy.address,
                                   redis_url=self.args.redis_url, cache_secret=uuid.uuid4().hex, **MODES[mode])
            gateway = await build_gateway(config, wait_for_verifier_s=600)
            self.gateways[mode] = (gateway, f"127.0.0.1:{await gateway.start('127.0.0.1', 0)}")

    async def stop(self) -> None:
        for gateway, _ in self.gateways.values():
            await gateway.stop(0)
        for server, engine in self.servers:                 # closes the proxied connections from the far end
            await server.stop(0)
            engine.stop()
        await asyncio.sleep(0.2)
        for proxy in self.proxies.values():
            await proxy.stop()

    async def ask(self, mode: str, prompt: Prompt, tenant: str) -> tuple[RequestResult, dict[str, int]]:
        """One request; returns it with its draft-link bytes (wire, both ways) and serialized Propose bytes."""
        gateway, addr = self.gateways[mode]
        link, stats = self.proxies[mode].stats, gateway.stats["drafting"]
        before = (link.bytes_up + link.bytes_down, stats())
        request = make_request(prompt, self.args.max_new_tokens, self.args.num_draft_tokens)
        result = await timed_request(addr, request, prompt, mode, tenant)
        after = stats()
        return result, {"wire_bytes": link.bytes_up + link.bytes_down - before[0],
                        "propose_bytes": sum(after[k] - before[1][k] for k in ("draft_bytes_sent",
                                                                               "draft_bytes_received"))}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    results = [r["result"] for r in rows]
    out = aggregate(results)
    tokens = max(1, sum(r.completion_tokens for r in results))
    out["wire_bytes_per_token"] = sum(r["wire_bytes"] for r in rows) / tokens
    out["propose_bytes_per_token"] = sum(r["propose_bytes"] for r in rows) / tokens
    return out


def report(table: dict[str, dict[str, dict[str, Any]]], modes: list[str]) -> None:
    print(f"{'mode':<6} {'asks':<5} {'tok/s':>7} {'speedup':>7} {'accept':>6} {'tok/rnd':>7} {'wire B/tok':>10} "
          f"{'Propose B/tok':>13}  sources")
    for part in ("all", "warm"):
        base = table[modes[0]][part]
        for mode in modes:
            s = table[mode][part]
            if not s.get("n") or not base.get("n"):
                continue
            speedup = s["aggregate_tok_s"] / base["aggregate_tok_s"]
            print(f"{mode:<6} {part:<5} {s['aggregate_tok_s']:7.1f} {speedup:6.2f}x"
                  f" {s['acceptance_rate']:6.2f} {s['mean_tokens_per_round']:7.2f} {s['wire_bytes_per_token']:10.1f}"
                  f" {s['propose_bytes_per_token']:13.1f}  {format_sources(s['sources'])}")


class Interrupt:
    """SIGTERM / SIGINT (e.g. from `timeout`): cancel the request in flight, stop asking, report what finished."""

    def __init__(self) -> None:
        self.requested = False
        self.current: asyncio.Future[Any] | None = None

    def __call__(self) -> None:
        self.requested = True
        if self.current is not None:
            self.current.cancel()

    async def run(self, coro: Any) -> Any:
        self.current = asyncio.ensure_future(coro)
        try:
            return await self.current
        finally:
            self.current = None


async def collect(bench: Bench, prompts: list[Prompt], asks: int, interrupt: Interrupt,
                  on_ask: Any) -> dict[str, list[dict[str, Any]]]:
    """Asks every prompt `asks` times through every mode; interrupted, returns the requests finished so far."""
    modes = bench.modes
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    tenants = {m: f"cache-repeats-{uuid.uuid4().hex[:8]}" for m in modes}
    try:
        for mode in modes:
            await interrupt.run(bench.ask(mode, Prompt("warmup", "warmup", "Say hello."), f"warm-{uuid.uuid4()}"))
        for ask in range(asks):
            for i, prompt in enumerate(prompts):
                order = modes[(ask + i) % len(modes):] + modes[:(ask + i) % len(modes)]   # no mode always first
                for mode in order:
                    result, link = await interrupt.run(bench.ask(mode, prompt, tenants[mode]))
                    rows[mode].append({"ask": ask, "result": result, **link})
            log(f"ask {ask + 1}/{asks} done")
            on_ask(rows)
    except asyncio.CancelledError:
        if not interrupt.requested:
            raise
        log("interrupted: reporting the requests finished so far")
    return rows


async def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: choose from {', '.join(MODES)}")
    prompts = load_workload(args.workload, [args.categories], splits=split_arg(args))
    asks = args.asks or max(p.repeat for p in prompts)
    json_path, _ = result_paths(args.name or f"cache-repeats-{args.preset}")
    interrupt = Interrupt()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, interrupt)
    bench = Bench(args, modes)
    log(f"starting {args.preset}: modes {modes}, {len(prompts)} prompts x {asks} asks, rtt {args.rtt_ms} ms")
    await bench.start()
    try:
        rows = await collect(bench, prompts, asks, interrupt,
                             lambda partial: write_results(args, json_path, modes, partial))   # saved per ask
    finally:
        await bench.stop()
    report(summary_table(rows, modes), modes)
    problems = write_results(args, json_path, modes, rows)
    for problem in problems:
        print(f"!!! {problem}")
    return 1 if problems else 0


def summary_table(rows: dict[str, list[dict[str, Any]]], modes: list[str]) -> dict[str, dict[str, Any]]:
    return {m: {"all": summarize(rows[m]), "warm": summarize([r for r in rows[m] if r["ask"] > 0])} for m in modes}


def write_results(args: argparse.Namespace, path: Path, modes: list[str],
                  rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Writes the JSON (summary, problems, requests); returns the problems (errors, differing outputs)."""
    outputs: dict[str, set[tuple[int, ...]]] = {}
    problems = [f"{r['result'].id} {m}: {r['result'].error}" for m in modes for r in rows[m] if r["result"].error]
    for m in modes:
        for r in rows[m]:
            outputs.setdefault(r["result"].id, set()).add(tuple(r["result"].token_ids))
    problems += [f"{pid}: {len(outs)} different outputs" for pid, outs in outputs.items() if len(outs) > 1]
    requests = {m: [{**r["result"].to_json(), "ask": r["ask"], "wire_bytes": r["wire_bytes"],
                     "propose_bytes": r["propose_bytes"]} for r in rows[m]] for m in modes}
    write_json(path, {"meta": run_metadata(args), "summary": summary_table(rows, modes), "problems": problems,
                      "requests": requests})
    return problems


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(asyncio.run(run(parse_args(argv))))


if __name__ == "__main__":
    main()
