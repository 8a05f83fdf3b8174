"""Placement of sessions on verifier replicas: prefix-cache hit rate and aggregate tokens/s for traffic that shares
system prompts, one arm per placement policy (`SPECMESH_GATEWAY_PLACEMENT`: prefix, least_loaded, round_robin).

Each arm starts its own verifier replica processes (cold prefix caches; `--pin`: replica i on core i) behind one
in-process gateway, sends `--systems` system prompts x `--users` questions with `--concurrency` streams at once
(greedy, target-only: the replica's prefix cache is what differs), and reads the gateway's counters:
hit rate = specmesh_prompt_cached_tokens / specmesh_prompt_tokens; "best" is the system prompts' full KV blocks in
every request but each system's first, over all prompt tokens (the most any placement can hit).

    python -m bench.placement --model tiny-target --replicas 2 --systems 3 --users 4     # smoke test (< 1 min)
    python -m bench.placement --model qwen2.5-coder-1.5b --replicas 2 --pin --systems 8 --users 16 --out p.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from gateway.placement import POLICIES, prefix_key
from gateway.server import build_gateway_parts
from specmesh.config import GatewayConfig
from specmesh.ops import client
from specmesh.ops.launcher import wait_serving

BLOCK_SIZE = 16


@dataclass(frozen=True)
class ArmResult:
    placement: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    cacheable_tokens: int
    generated_tokens: int
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def best_hit_rate(self) -> float:
        """What a placement that never misses a cached block could reach: the first request of each system
        prompt computes its blocks (traffic() sends every system's first request before any second one)."""
        return self.cacheable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


def system_prompt(i: int, words: int) -> str:
    """A system prompt of its own per i (long enough for a few full KV blocks)."""
    return f"System {i}: " + " ".join(f"rule{i}-{w} applies." for w in range(words)) + "\n"


def traffic(num_systems: int, num_users: int, words: int) -> list[str]:
    """Every user's question under every system prompt, interleaved (system 0 user 0, system 1 user 0, ...)."""
    return [system_prompt(s, words) + f"Question {u}: what is {u} plus {s}?"
            for u in range(num_users) for s in range(num_systems)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_replica(model: str, port: int, core: int | None, threads: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SPECMESH_VERIFIER_PORT": str(port), "SPECMESH_VERIFIER_MODEL": model,
           "SPECMESH_VERIFIER_NUM_THREADS": str(threads), "SPECMESH_VERIFIER_DECODE_AHEAD_TOKENS": "0"}
    pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
    return subprocess.Popen([sys.executable, "-m", "verifier_service"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=pin)


async def run_arm(placement: str, args: argparse.Namespace, prompts: Sequence[str]) -> ArmResult:
    ports = [free_port() for _ in range(args.replicas)]
    procs = [spawn_replica(args.model, p, i if args.pin else None, args.threads) for i, p in enumerate(ports)]
    try:
        for proc, port in zip(procs, ports, strict=True):
            await asyncio.to_thread(wait_serving, f"127.0.0.1:{port}", args.start_timeout_s, proc)
        config = GatewayConfig(port=0, verifier_addr=",".join(f"127.0.0.1:{p}" for p in ports), draft_addr="",
                               enable_cache=False, enable_ngram=False, placement=placement)
        gateway = await build_gateway_parts(config, wait_for_verifier_s=args.start_timeout_s)
        port = await gateway.server.start("127.0.0.1", 0)
        try:
            generated, wall_s = await send(f"127.0.0.1:{port}", prompts, args)
            registry = gateway.metrics.registry
            tokenizer = gateway.tokenizer
            prompt_tokens = int(registry.get_sample_value("specmesh_prompt_tokens_total") or 0)
            cached = int(registry.get_sample_value("specmesh_prompt_cached_tokens_total") or 0)
        finally:
            await gateway.server.stop(0)
    finally:
        for proc in procs:
            proc.kill()
    system_len = len(tokenizer(system_prompt(0, args.words))["input_ids"])
    cacheable = sum(shared_block_tokens(tokenizer(p)["input_ids"], system_len) for p in prompts[args.systems:])
    return ArmResult(placement, len(prompts), prompt_tokens, cached, cacheable, generated, wall_s)


def shared_block_tokens(prompt_ids: Sequence[int], system_len: int) -> int:
    """Tokens of the prompt's full KV blocks inside its system prompt (about: the systems' lengths differ by a token
    or two, and the system's last token may merge with the question's first)."""
    usable = min(system_len - 2, len(prompt_ids) - 1)           # the last prompt token is never cached
    return max(0, usable) // BLOCK_SIZE * BLOCK_SIZE if prefix_key(prompt_ids, BLOCK_SIZE) else 0


async def send(addr: str, prompts: Sequence[str], args: argparse.Namespace) -> tuple[int, float]:
    """All prompts, `concurrency` at a time; (tokens generated, wall seconds)."""
    queue = list(prompts)
    generated = 0

    async def worker() -> None:
        nonlocal generated
        while queue:
            request = client.make_request(queue.pop(0), max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                          num_draft_tokens=0)
            async for r in client.stream(addr, request, timeout_s=600):
                generated += len(r.token_ids)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return generated, time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-target")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--placement", default="prefix,round_robin",
                        help=f"comma-separated arms among {', '.join(POLICIES)}")
    parser.add_argument("--systems", type=int, default=4, help="distinct system prompts")
    parser.add_argument("--users", type=int, default=8, help="questions per system prompt")
    parser.add_argument("--words", type=int, default=24, help="rules per system prompt (its length)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--pin", action="store_true", help="replica i runs on core i only")
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default="", help="write the results as JSON here")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.placement.split(",") if a.strip()]
    bad = [a for a in arms if a not in POLICIES]
    if bad:
        parser.error(f"--placement: {bad[0]!r} is not one of {', '.join(POLICIES)}")
    prompts = traffic(args.systems, args.users, args.words)
    results = [asyncio.run(run_arm(arm, args, prompts)) for arm in arms]
    print(f"{'placement':<14}{'hit rate':>10}{'best':>8}{'tok/s':>9}{'requests':>10}")
    for r in results:
        print(f"{r.placement:<14}{r.hit_rate:>10.1%}{r.best_hit_rate:>8.1%}{r.tokens_per_s:>9.1f}{r.requests:>10}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "arms": [{**asdict(r), "hit_rate": r.hit_rate, "best_hit_rate":
                                                     r.best_hit_rate, "tokens_per_s": r.tokens_per_s}
                                                    for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
