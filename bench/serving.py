"""Serving benchmark: open-loop traffic (Poisson arrivals at several rates, ShareGPT-like prompt and answer lengths,
bench/serving_mix.py) against specmesh's streaming gRPC API, target-only (num_draft_tokens=0) and with the
gateway's defaults, and the same traffic against `llama-server -np 4` (4 continuous-batching slots, target-only,
same GGUF, threads and cores; bench/serving_peer.py) when its binary is found. Per rate and configuration: TTFT
p50/p99, inter-token latency p50/p99, the longest stall of any stream, aggregate throughput
(bench/serving_clients.py). Greedy output with the defaults must equal target-only's, request for request.

    python -m bench.serving --start-stack --preset qwen --threads 1 --cpus 0,1 --rates 0.05,0.1,0.2 \\
        --num-requests 24 --max-output-tokens 128 --llama-server PATH/llama-server
    python -m bench.serving --start-stack --preset tiny --rates 2 --num-requests 4 --max-output-tokens 8

Writes JSON (and a PNG when matplotlib is installed) to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from transformers import AutoTokenizer

from bench.common import (
    add_stack_args,
    add_workload_args,
    load_workload,
    log,
    pyplot,
    result_paths,
    run_metadata,
    split_csv,
    stack_addr,
    write_json,
)
from bench.serving_clients import grpc_sender, http_sender, percentile, run_open_loop, summarize
from bench.serving_mix import TrafficRequest, arrivals, build_traffic
from bench.serving_peer import find_server, running_server, target_gguf
from specmesh.models import resolve_model_dir
from specmesh.ops.launcher import PRESETS

STACK_CONFIGS = {"target": 0, "spec": None}      # num_draft_tokens per request: 0 = target-only, None = defaults
PEER = "llama-server"
CONFIGS = (*STACK_CONFIGS, PEER)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    add_stack_args(p)
    p.add_argument("--rates", default="0.05,0.1,0.2", help="arrival rates, requests per second")
    p.add_argument("--num-requests", type=int, default=24, help="requests per rate and configuration")
    p.add_argument("--seed", type=int, default=0, help="seeds the lengths, prompts and arrival times")
    p.add_argument("--max-prompt-tokens", type=int, default=4096)
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--output-scale", type=float, default=1.0, help="ShareGPT answer length factor (then capped)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--llama-server", default="", help="llama-server binary (else $SPECMESH_LLAMA_SERVER or PATH)")
    p.add_argument("--cpus", default="", help="taskset -c cpu list for every service and the peer ('' = none)")
    p.add_argument("--peer-threads", type=int, default=0,
                   help="llama-server threads (0 = the stack's model cores: --cpus, else 2x --threads)")
    p.add_argument("--cache", choices=("cold", "shared"), default="cold",
                   help="cold (default): every rate and configuration sends its own prompts (a tag opens each), so "
                        "no run meets another's in the prefix cache, like llama-server without cache_prompt; "
                        "shared: the configurations of a rate send the same prompts and the defaults' greedy "
                        "output is checked against target-only's (the second configuration finds the first's "
                        "prompts cached)")
    p.add_argument("--name", default="")
    args = p.parse_args(argv)
    unknown = set(split_csv(args.configs)) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    return args


def stack(args: argparse.Namespace) -> contextlib.AbstractContextManager[str]:
    """The gateway address: `--addr`, or a stack started for the block (every service pinned to --cpus)."""
    return stack_addr(args, dict.fromkeys(("verifier", "draft", "gateway"), args.cpus) if args.cpus else None)


def salted(traffic: list[TrafficRequest], tag: str) -> list[TrafficRequest]:
    """The requests with `tag` opening each one's first message: a prefix cache holds nothing of another run's."""
    return [replace(r, messages=[(r.messages[0][0], f"[{tag}] {r.messages[0][1]}"), *r.messages[1:]])
            for r in traffic]


async def run_configs(senders: dict[str, tuple[Any, Any]], traffic: list[TrafficRequest], rates: list[float],
                      seed: int, cache: str = "cold") -> list[dict[str, Any]]:
    """One unmeasured short request per configuration, then the traffic at every rate (same requests, arrival times
    from the rate and seed), the configurations' order alternating between rates (drift hits all alike). Each run's
    prompts open with a tag of its rate and, with `cache` "cold", its configuration: no run finds another's
    prompts in specmesh's prefix cache (llama-server runs with cache_prompt off); "shared": the configurations of one
    rate send the same prompts, so the second finds the first's in the cache, and greedy outputs compare."""
    rows = []
    shortest = min(traffic, key=lambda r: r.prompt_tokens)
    warm = TrafficRequest("warm-up", shortest.kind, shortest.messages, shortest.prompt_tokens, 4)
    try:
        for config, (send, _) in senders.items():
            await run_open_loop(send, [warm], [0.0], config)
        for i, rate in enumerate(rates):
            for config in list(senders)[::-1 if i % 2 else 1]:
                tag = f"run {i + 1}" + (f" {config}" if cache == "cold" else "")
                results, wall = await run_open_loop(senders[config][0], salted(traffic, tag),
                                                    arrivals(len(traffic), rate, seed), config)
                rows.append({"rate": rate, "config": config, "wall_s": wall, "summary": summarize(results),
                             "results": results})
                _log_row(rows[-1])
    finally:
        for _, close in senders.values():
            await close()
    return rows


def _log_row(row: dict[str, Any]) -> None:
    s = row["summary"]
    log(f"{row['config']:<13} {row['rate']:6.3f} req/s: {s['throughput_tok_s']:7.2f} tok/s, TTFT p50/p99 "
        f"{s['ttft_p50_s']:.2f}/{s['ttft_p99_s']:.2f} s, ITL p50/p99 {s['itl_p50_s']:.3f}/{s['itl_p99_s']:.3f} s, "
        f"longest stall {s['max_stall_s']:.2f} s, {s['errors']} errors")


async def run_stack(addr: str, configs: list[str], traffic: list[TrafficRequest], rates: list[float],
                    seed: int, cache: str = "cold") -> list[dict[str, Any]]:
    return await run_configs({c: grpc_sender(addr, STACK_CONFIGS[c]) for c in configs}, traffic, rates, seed,
                             cache)


async def run_peer(base_url: str, traffic: list[TrafficRequest], rates: list[float], seed: int,
                   cache: str = "cold") -> list[dict]:
    return await run_configs({PEER: http_sender(base_url, {"cache_prompt": False})}, traffic, rates, seed, cache)


def check_exact(rows: list[dict[str, Any]], compare: bool = True) -> list[dict[str, Any]]:
    """Per rate: every request's tokens with the defaults equal its target-only tokens (greedy, where both sent the
    same prompts: `--cache shared`); errors count."""
    problems = []
    for row in rows:
        problems += [{"rate": row["rate"], "config": row["config"], "id": r.id, "error": r.error}
                     for r in row["results"] if r.error]
    by = {(row["rate"], row["config"]): row["results"] for row in rows}
    for rate in sorted({row["rate"] for row in rows}) if compare else []:
        target, spec = by.get((rate, "target")), by.get((rate, "spec"))
        if target and spec:
            problems += [{"rate": rate, "config": "spec", "id": s.id, "mismatch": True}
                         for t, s in zip(target, spec, strict=True)
                         if not t.error and not s.error and t.token_ids != s.token_ids]
    for p in problems:
        log(f"!!! {p}")
    return problems


def describe_mix(traffic: list[TrafficRequest]) -> dict[str, Any]:
    lengths = [r.prompt_tokens for r in traffic]
    return {"requests": len(traffic), "documents": sum(r.kind == "document" for r in traffic),
            "prompt_tokens_p50": percentile(lengths, 50), "prompt_tokens_max": max(lengths),
            "output_tokens_total": sum(r.max_tokens for r in traffic),
            "requests_detail": [{"id": r.id, "prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens}
                                for r in traffic]}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'rate/s':>7} {'config':<13}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
          f"{'stall':>8}{'errors':>7}")
    for row in sorted(rows, key=lambda r: (r["rate"], CONFIGS.index(r["config"]))):
        s = row["summary"]
        print(f"{row['rate']:>7.3f} {row['config']:<13}{s['throughput_tok_s']:>8.2f}{s['ttft_p50_s']:>10.2f}"
              f"{s['ttft_p99_s']:>10.2f}{s['itl_p50_s']:>9.3f}{s['itl_p99_s']:>9.3f}{s['max_stall_s']:>8.2f}"
              f"{s['errors']:>7}")


def plot(rows: list[dict[str, Any]], path: Any, title: str) -> None:
    plt = pyplot()
    if plt is None or not rows:
        return
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = (("throughput_tok_s", "tokens/s", "throughput"), ("ttft_p99_s", "s", "TTFT p99"),
              ("itl_p99_s", "s", "inter-token latency p99"), ("max_stall_s", "s", "longest stall"))
    for ax, (key, unit, name) in zip(axes, panels, strict=True):
        for config in dict.fromkeys(r["config"] for r in rows):
            pts = sorted((r["rate"], r["summary"][key]) for r in rows if r["config"] == config)
            ax.plot(*zip(*pts, strict=True), marker="o", label=config)
        ax.set(xlabel="arrival rate (requests/s)", ylabel=unit, title=name)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def peer_section(args: argparse.Namespace, configs: list[str]) -> tuple[str, Any, dict[str, Any]]:
    """(binary, gguf, what the report says about the peer); binary '' = skipped."""
    if PEER not in configs:
        return "", None, {"skipped": "not asked for (--configs)"}
    server, gguf = find_server(args.llama_server), target_gguf(args.preset)
    if not server or gguf is None:
        reason = "no llama-server binary" if not server else f"no GGUF file for preset {args.preset}"
        log(f"llama-server peer skipped: {reason}")
        return "", None, {"skipped": reason}
    threads = args.peer_threads or (len(args.cpus.split(",")) if args.cpus else 2 * args.threads)
    return server, gguf, {"server": server, "gguf": str(gguf), "threads": threads, "slots": 4, "cpus": args.cpus}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    meta = run_metadata(args)
    configs = split_csv(args.configs)
    rates = [float(r) for r in split_csv(args.rates)]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(PRESETS[args.preset][0]))
    chats = load_workload(args.workload, split_csv(args.categories), True, args.limit)
    traffic = build_traffic(args.num_requests, args.seed, tokenizer, chats, args.max_prompt_tokens,
                            args.max_output_tokens, args.output_scale)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    stack_configs = [c for c in configs if c in STACK_CONFIGS]
    if stack_configs:
        with stack(args) as addr:
            rows += asyncio.run(run_stack(addr, stack_configs, traffic, rates, args.seed, args.cache))
    server, gguf, peer = peer_section(args, configs)
    if server:
        try:
            with running_server(server, gguf, peer["threads"], args.cpus) as base_url:
                rows += asyncio.run(run_peer(base_url, traffic, rates, args.seed, args.cache))
        except (RuntimeError, TimeoutError, OSError) as exc:     # the stack's results survive a bad peer
            peer["failed"] = str(exc)
            log(f"llama-server peer failed: {exc}")
    problems = check_exact(rows, compare=args.cache == "shared")
    print_table(rows)
    write_report(args, meta, traffic, rows, peer, problems, time.perf_counter() - started)
    return 1 if specmesh_problems(problems) else 0


def specmesh_problems(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The problems that fail the run: specmesh's errors and mismatches. The peer's errors are reported (table,
    JSON) but are the peer's (llama-server -np 4 dropped a connection at 0.2 req/s once)."""
    return [p for p in problems if p["config"] != PEER]


def write_report(args: argparse.Namespace, meta: dict[str, Any], traffic: list[TrafficRequest],
                 rows: list[dict[str, Any]], peer: dict[str, Any], problems: list[dict[str, Any]],
                 wall_s: float) -> Any:
    """bench/results/<name>-<time>.json (and .png); returns the JSON's path."""
    name = args.name or f"serving-{args.preset}"
    json_path, png_path = result_paths(name)
    write_json(json_path, {"meta": meta, "mix": describe_mix(traffic), "peer": peer, "problems": problems,
                           "wall_s": wall_s,
                           "rows": [{**{k: v for k, v in r.items() if k != "results"},
                                     "requests": [x.to_json() for x in r["results"]]} for r in rows]})
    plot(rows, png_path, f"{name}: {args.num_requests} requests per rate, outputs <= {args.max_output_tokens}")
    return json_path


if __name__ == "__main__":
    sys.exit(main())
