"""Floods a gateway with maximal requests (every input at its cap, specmesh.config.InputLimits) and reports the
gateway's peak RSS: the bound stated in README "Input limits".

    .venv/bin/python -m bench.flood_rss --preset tiny --requests 8 --concurrency 2      # smoke (< 1 min)
    .venv/bin/python -m bench.flood_rss --preset tiny --requests 400 --concurrency 16   # the README figure

A stack (verifier, draft service, gateway with its HTTP API) runs as processes on free ports. The flood mixes, at
--concurrency at once: POST /v1/tokenize with a prompt of max_prompt_chars characters that tokenize to as many
tokens as the cap allows (multi-byte characters), /v1/tokenize with max_messages messages holding max_prompt_chars
characters, /v1/completions and /v1/chat/completions of the same size (refused after tokenizing: the prompt
exceeds the context), bodies just over max_body_bytes (413), and gRPC Generate calls with a maximal prompt and
max_stop_strings stop strings. The gateway's VmRSS is sampled every 50 ms (and VmHWM read at the end). Writes
bench/results/flood-rss-<preset>-<time>.json; exit code 1 when a request got a 5xx or INTERNAL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import free_port_block, log, result_paths, run_metadata  # noqa: E402
from protos.specmesh.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402
from specmesh.config import InputLimits  # noqa: E402
from specmesh.ops.launcher import PRESETS, Stack, StackConfig  # noqa: E402

ALPHABET = "ab😀é中\u0394x "          # multi-byte characters: many tokens per character with byte-level BPE


def proc_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def maximal_text(rng: random.Random, chars: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(chars))


def http_bodies(limits: InputLimits, rng: random.Random) -> list[tuple[str, bytes]]:
    prompt = maximal_text(rng, limits.max_prompt_chars)
    per_message = limits.max_prompt_chars // limits.max_messages
    messages = [{"role": "user", "content": maximal_text(rng, per_message)} for _ in range(limits.max_messages)]
    stop = ["s" * limits.max_stop_string_len] * limits.max_stop_strings
    bodies = [("/v1/tokenize", {"prompt": prompt}), ("/v1/tokenize", {"messages": messages}),
              ("/v1/completions", {"prompt": prompt, "stop": stop, "max_tokens": 4}),
              ("/v1/chat/completions", {"messages": messages, "stop": stop, "max_tokens": 4})]
    out = [(path, json.dumps(body, ensure_ascii=False).encode()) for path, body in bodies]
    out.append(("/v1/tokenize", b'{"prompt": "' + b"a" * limits.max_body_bytes + b'"}'))      # over the cap: 413
    return [(path, raw) for path, raw in out]


async def http_call(session: aiohttp.ClientSession, url: str, raw: bytes) -> str:
    async with session.post(url, data=raw, headers={"Content-Type": "application/json"}) as response:
        await response.read()
        return str(response.status)


async def grpc_call(stub: generate_pb2_grpc.GenerationStub, request: generate_pb2.GenerateRequest) -> str:
    try:
        await stub.Complete(request, timeout=120)
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


async def flood(stack: Stack, http_port: int, limits: InputLimits, args: argparse.Namespace,
                samples: list[tuple[float, int]]) -> Counter[str]:
    rng = random.Random(0)
    bodies = http_bodies(limits, rng)
    big = generate_pb2.GenerateRequest(prompt=maximal_text(rng, limits.max_prompt_chars), max_new_tokens=4,
                                       stop=["s" * limits.max_stop_string_len] * limits.max_stop_strings)
    outcomes: Counter[str] = Counter()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session, \
            grpc.aio.insecure_channel(stack.config.gateway_addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        async def client() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                if i % (len(bodies) + 1) == len(bodies):
                    outcomes["grpc Generate " + await grpc_call(stub, big)] += 1
                else:
                    path, raw = bodies[i % (len(bodies) + 1)]
                    status = await http_call(session, f"http://127.0.0.1:{http_port}{path}", raw)
                    outcomes[f"{path} {status}"] += 1

        pid = stack.procs["gateway"].pid
        done = asyncio.Event()

        async def sample() -> None:
            t0 = time.monotonic()
            while not done.is_set():
                samples.append((round(time.monotonic() - t0, 2), proc_kb(pid, "VmRSS")))
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        done.set()
        await sampler
    return outcomes


def run(args: argparse.Namespace) -> dict[str, Any]:
    limits = InputLimits()
    base = free_port_block(4)
    target, draft = PRESETS[args.preset]
    stack = Stack(StackConfig(target=target, draft=draft, gateway_port=base, verifier_port=base + 1,
                              draft_port=base + 2, http_port=base + 3), echo_output=False)
    stack.start()
    try:
        pid = stack.procs["gateway"].pid
        before_kb = proc_kb(pid, "VmRSS")
        samples: list[tuple[float, int]] = []
        started = time.monotonic()
        outcomes = asyncio.run(flood(stack, base + 3, limits, args, samples))
        elapsed = time.monotonic() - started
        after_kb, hwm_kb = proc_kb(pid, "VmRSS"), proc_kb(pid, "VmHWM")
    finally:
        stack.stop()
    peak_kb = max([kb for _, kb in samples] + [hwm_kb])
    bad = {k: v for k, v in outcomes.items() if k.split()[-1].startswith("5") or k.endswith(("INTERNAL", "UNKNOWN"))}
    return {"preset": args.preset, "requests": args.requests, "concurrency": args.concurrency, "seconds": elapsed,
            "limits": vars(limits), "outcomes": dict(outcomes), "bad": bad,
            "gateway_rss_mb": {"before": before_kb / 1024, "peak": peak_kb / 1024, "after": after_kb / 1024,
                               "growth_peak": (peak_kb - before_kb) / 1024}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    result = run(args)
    result["meta"] = run_metadata(args)
    path, _ = result_paths(f"flood-rss-{args.preset}")
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    rss = result["gateway_rss_mb"]
    print(f"gateway RSS: {rss['before']:.0f} MB before, peak {rss['peak']:.0f} MB (+{rss['growth_peak']:.0f}), "
          f"{rss['after']:.0f} MB after {args.requests} maximal requests at {args.concurrency} at once "
          f"({result['seconds']:.1f} s)")
    for key, count in sorted(result["outcomes"].items()):
        print(f"  {key}: {count}")
    log(f"wrote {path}")
    sys.exit(1 if result["bad"] else 0)


if __name__ == "__main__":
    main()
