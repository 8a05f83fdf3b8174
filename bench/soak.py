"""Soak test (a script, not a CI test): concurrent streams with random cancellations while the draft service and
Redis are restarted, for a fixed time. At the end: leaked KV blocks and sessions, RSS growth, errors by code.

    python bench/soak.py --duration-s 1800 --streams 8          # the 30-minute run reported in the notes
    python bench/soak.py --duration-s 60 --streams 4            # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protos.specmesh.v1 import generate_pb2_grpc, verifier_pb2, verifier_pb2_grpc  # noqa: E402
from specmesh import client  # noqa: E402
from specmesh.launcher import PRESETS, Stack, StackConfig  # noqa: E402

PROMPTS = ["The quick brown fox", "def merge_sort(xs):", "سلام، امروز هوا چطور است؟", "Explain paged attention.",
           "SELECT name FROM users WHERE", "Once upon a time"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Redis:
    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)

    def restart(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()


async def one_request(stub: generate_pb2_grpc.GenerationStub, rng: random.Random, cancel_prob: float,
                      codes: collections.Counter[str]) -> int:
    request = client.make_request(rng.choice(PROMPTS), max_new_tokens=rng.randint(8, 96), ignore_eos=rng.random() < 0.5,
                                  num_draft_tokens=rng.randint(0, 6), temperature=rng.choice([0.0, 0.0, 0.8]),
                                  seed=rng.randint(0, 10**6))
    cancel_after = rng.randint(1, 6) if rng.random() < cancel_prob else None
    call = stub.Generate(request, timeout=120)
    tokens = 0
    try:
        async for i, response in aenumerate(call):
            tokens += len(response.token_ids)
            if cancel_after is not None and i >= cancel_after:
                call.cancel()
                codes["CANCELLED_BY_CLIENT"] += 1
                return tokens
        codes["OK"] += 1
    except grpc.aio.AioRpcError as exc:
        codes[exc.code().name] += 1
    except asyncio.CancelledError:
        codes["CANCELLED_BY_CLIENT"] += 1
    return tokens


async def aenumerate(it):
    i = 0
    async for x in it:
        yield i, x
        i += 1


async def worker(addr: str, deadline: float, seed: int, cancel_prob: float, codes: collections.Counter[str],
                 tokens: list[int]) -> None:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            tokens[0] += await one_request(stub, rng, cancel_prob, codes)


async def chaos(stack: Stack, redis: Redis | None, deadline: float, draft_every_s: float, redis_every_s: float,
                events: list[str]) -> None:
    next_draft = time.monotonic() + draft_every_s
    next_redis = time.monotonic() + redis_every_s
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        now = time.monotonic()
        if stack.config.draft and now >= next_draft:
            await asyncio.to_thread(stack.restart, "draft")
            events.append(f"{now:.0f} draft restarted")
            next_draft = time.monotonic() + draft_every_s
        if redis is not None and now >= next_redis:
            redis.restart()
            events.append(f"{now:.0f} redis restarted")
            next_redis = now + redis_every_s


async def verifier_state(addr: str) -> verifier_pb2.ModelInfo:
    async with grpc.aio.insecure_channel(addr) as channel:
        return await verifier_pb2_grpc.VerifierStub(channel).GetModelInfo(verifier_pb2.GetModelInfoRequest())


async def run(args: argparse.Namespace) -> dict:
    target, draft = PRESETS[args.preset]
    redis = Redis(free_port()) if shutil.which("redis-server") and not args.no_redis else None
    extra = {}
    if redis is not None:
        redis.start()
        extra["SPECMESH_GATEWAY_REDIS_URL"] = f"redis://127.0.0.1:{redis.port}/0"
    stack = Stack(StackConfig(target=target, draft=draft, gateway_port=free_port(), verifier_port=free_port(),
                              draft_port=free_port(), extra_env=extra))
    stack.start()
    try:
        await asyncio.sleep(2)
        rss_start = {name: rss_mb(p.pid) for name, p in stack.procs.items()}
        codes: collections.Counter[str] = collections.Counter()
        tokens = [0]
        events: list[str] = []
        deadline = time.monotonic() + args.duration_s
        await asyncio.gather(
            *[worker(stack.config.gateway_addr, deadline, i, args.cancel_prob, codes, tokens)
              for i in range(args.streams)],
            chaos(stack, redis, deadline, args.draft_restart_every_s, args.redis_restart_every_s, events))
        await asyncio.sleep(3)                      # let cleanups of cancelled streams land
        info = await verifier_state(f"{stack.config.host}:{stack.config.verifier_port}")
        rss_end = {name: rss_mb(p.pid) for name, p in stack.procs.items()}
    finally:
        stack.stop()
        if redis is not None:
            redis.stop()
    return {"duration_s": args.duration_s, "streams": args.streams, "preset": args.preset,
            "requests_by_outcome": dict(codes), "tokens": tokens[0], "events": events,
            "leaked_kv_blocks": info.num_kv_blocks - info.num_free_kv_blocks, "leaked_sessions": info.num_sessions,
            "rss_mb_start": rss_start, "rss_mb_end": rss_end}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--duration-s", type=float, default=60)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--cancel-prob", type=float, default=0.2)
    parser.add_argument("--draft-restart-every-s", type=float, default=45)
    parser.add_argument("--redis-restart-every-s", type=float, default=30)
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    ok = result["leaked_kv_blocks"] == 0 and result["leaked_sessions"] == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
