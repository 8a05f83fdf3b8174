"""Tracing overhead: tokens/s with tracing on vs off, measured in the same run.

Two stacks of the same model pair run side by side as real processes (`specmesh up` style): one with tracing off
(no SDK: the API is a no-op), one with every service exporting spans to a JSON-lines file. The same requests go
to both, interleaved one at a time and alternating which stack goes first, so machine noise hits both alike.

    .venv/bin/python bench/tracing_overhead.py --preset tiny --rounds 6 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import DEFAULT_WORKLOAD
from specmesh.ops import client
from specmesh.ops.launcher import PRESETS, Stack, StackConfig

WORKLOAD = Path(DEFAULT_WORKLOAD)
FALLBACK_PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return", "Once upon a time, in a city on a hill"]


def prompts(limit: int) -> list[str]:
    if WORKLOAD.exists():
        rows = [json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.strip()]
        return [r["prompt"] for r in rows][:limit]
    return FALLBACK_PROMPTS[:limit]


def stack_config(preset: str, base_port: int, trace_file: str, sample_ratio: float = 1.0) -> StackConfig:
    target, draft = PRESETS[preset]
    env = {f"SPECMESH_{svc}_TRACE_FILE": trace_file for svc in ("GATEWAY", "VERIFIER", "DRAFT")} if trace_file else {}
    if trace_file and sample_ratio < 1.0:   # the OTel SDK's own sampler settings; services follow the gateway's choice
        env |= {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(sample_ratio)}
    return StackConfig(target=target, draft=draft, gateway_port=base_port, verifier_port=base_port + 1,
                       draft_port=base_port + 2, extra_env=env)


def cpu_seconds(stack: Stack) -> float:
    """user + system CPU time of the stack's processes so far (robust to other load on the machine)."""
    total = 0
    for proc in stack.procs.values():
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def one_request(addr: str, prompt: str, max_new_tokens: int, k: int) -> tuple[int, float]:
    request = client.make_request(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, num_draft_tokens=k)
    start = time.perf_counter()
    tokens = 0
    async for response in client.stream(addr, request, timeout_s=600):
        tokens += len(response.token_ids)
    return tokens, time.perf_counter() - start


async def measure(addrs: dict[str, str], texts: list[str], rounds: int, max_new_tokens: int,
                  k: int) -> dict[str, list[tuple[int, float]]]:
    """Each prompt goes to every stack back to back, alternating which goes first."""
    results: dict[str, list[tuple[int, float]]] = {name: [] for name in addrs}
    for addr in addrs.values():                           # warm-up, not counted
        await one_request(addr, texts[0], 8, k)
    for r in range(rounds):
        for i, text in enumerate(texts):
            order = list(addrs) if (r + i) % 2 == 0 else list(reversed(addrs))
            for name in order:
                results[name].append(await one_request(addrs[name], text, max_new_tokens, k))
    return results


def interleaved(configs: dict[str, StackConfig], texts: list[str],
                args: argparse.Namespace) -> tuple[dict[str, list[tuple[int, float]]], dict[str, float]]:
    """Both stacks up at once (needs memory for two model pairs)."""
    stacks = {name: Stack(c) for name, c in configs.items()}
    try:
        for stack in stacks.values():
            stack.start()
        start = {name: cpu_seconds(s) for name, s in stacks.items()}
        addrs = {name: s.config.gateway_addr for name, s in stacks.items()}
        results = asyncio.run(measure(addrs, texts, args.rounds, args.max_new_tokens, args.num_draft_tokens))
        return results, {name: cpu_seconds(s) - start[name] for name, s in stacks.items()}
    finally:
        for stack in stacks.values():
            stack.stop()


def sequential(configs: dict[str, StackConfig], texts: list[str],
               args: argparse.Namespace) -> tuple[dict[str, list[tuple[int, float]]], dict[str, float]]:
    """One stack at a time (large models): arms alternate, one pass over the prompts each, `rounds` times."""
    results: dict[str, list[tuple[int, float]]] = {name: [] for name in configs}
    cpu = dict.fromkeys(configs, 0.0)
    for r in range(args.rounds):
        for name in (list(configs) if r % 2 == 0 else list(reversed(configs))):
            stack = Stack(configs[name])
            try:
                stack.start()
                start = cpu_seconds(stack)
                addr = {name: stack.config.gateway_addr}
                results[name] += asyncio.run(measure(addr, texts, 1, args.max_new_tokens,
                                                     args.num_draft_tokens))[name]
                cpu[name] += cpu_seconds(stack) - start
            finally:
                stack.stop()
    return results, cpu


def report(results: dict[str, list[tuple[int, float]]], cpu: dict[str, float], trace_file: Path) -> None:
    rate = {name: sum(t for t, _ in rs) / sum(s for _, s in rs) for name, rs in results.items()}
    # tokens/s on / tokens/s off of the same request sent to both stacks back to back
    per_pair = [(on[0] / on[1]) / (off[0] / off[1]) for off, on in zip(results["off"], results["on"], strict=True)]
    overhead = (1 - rate["on"] / rate["off"]) * 100
    spans = sum(1 for _ in trace_file.open()) if trace_file.exists() else 0
    print(f"requests per arm: {len(results['off'])}, tokens per arm: {sum(t for t, _ in results['off'])}")
    print(f"tracing off: {rate['off']:.1f} tokens/s")
    print(f"tracing on : {rate['on']:.1f} tokens/s  ({spans} spans written)")
    print(f"overhead   : {overhead:+.2f}% slower "
          f"(median per-request tokens/s ratio on/off {statistics.median(per_pair):.3f})")
    tokens = sum(t for t, _ in results["off"])
    print(f"CPU        : off {cpu['off'] / tokens * 1e3:.2f} ms/token, on {cpu['on'] / tokens * 1e3:.2f} ms/token "
          f"({(cpu['on'] / cpu['off'] - 1) * 100:+.2f}% CPU with tracing)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--rounds", type=int, default=4, help="passes over the prompts")
    parser.add_argument("--prompts", type=int, default=6, help="prompts used from the workload")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--sequential", action="store_true", help="one stack at a time (large models)")
    parser.add_argument("--sample-ratio", type=float, default=1.0,
                        help="trace this fraction of requests in the 'on' stack (OTEL_TRACES_SAMPLER)")
    args = parser.parse_args()
    base = random.randrange(56000, 64000, 10)
    with tempfile.TemporaryDirectory() as tmp:
        trace_file = Path(tmp) / "spans.jsonl"
        configs = {"off": stack_config(args.preset, base, ""),
                   "on": stack_config(args.preset, base + 5, str(trace_file), args.sample_ratio)}
        run = sequential if args.sequential else interleaved
        results, cpu = run(configs, prompts(args.prompts), args)
        report(results, cpu, trace_file)


if __name__ == "__main__":
    main()
