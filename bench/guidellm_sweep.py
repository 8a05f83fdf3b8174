"""guidellm's rate sweep (its own measurements) against specmesh's OpenAI-compatible HTTP API and, in the same run,
against `llama-server -np 4` on the same GGUF file and cores (bench/serving_peer.py).

    python -m bench.guidellm_sweep --preset qwen --llama-server PATH/llama-server      # ~10 min on 2 cores
    python -m bench.guidellm_sweep --preset tiny --targets specmesh --max-requests 4 --output-tokens 8

guidellm (`make load-tools` builds .venv-guidellm) runs `--profile kind=sweep`: a synchronous benchmark, a
throughput one, and Poisson rates between the two (`strategy_type=poisson`); each stops after
`--max-requests` requests. Prompts and answers
are its synthetic text (`--prompt-tokens`, `--output-tokens`), tokenized with the target's own tokenizer. specmesh
runs its shipped defaults (the gateway chooses drafting per round). Per server and benchmark the table shows
guidellm's request rate, output tokens/s, TTFT and inter-token latency (median and p99); the JSON keeps guidellm's
own reports. Writes bench/results/<name>-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.common import free_port_block, log, parse_env, result_paths, run_metadata, split_csv, write_json
from bench.serving_peer import find_server, running_server, target_gguf
from specmesh.models import resolve_model_dir
from specmesh.ops.launcher import PRESETS, Stack, StackConfig
from specmesh.ops.warmup import warm_up

ROOT = Path(__file__).resolve().parent.parent
GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
TARGETS = ("specmesh", "llama-server")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen")
    p.add_argument("--threads", type=int, default=1, help="torch threads per model service")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"of {', '.join(TARGETS)}")
    p.add_argument("--llama-server", default="", help="binary (else $SPECMESH_LLAMA_SERVER or PATH)")
    p.add_argument("--peer-threads", type=int, default=2, help="llama-server threads (default: both cores)")
    p.add_argument("--sweep-size", type=int, default=5,
                   help="benchmarks: synchronous, throughput, rates between (at least 2, guidellm's minimum)")
    p.add_argument("--max-requests", type=int, default=8, help="requests per benchmark")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--guidellm", default=str(GUIDELLM))
    p.add_argument("--name", default="guidellm-sweep")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for specmesh's services, e.g. SPECMESH_GATEWAY_TRACE_FILE=g.jsonl")
    args = p.parse_args(argv)
    if args.sweep_size < 2:        # else guidellm refuses it after the stack has started
        p.error(f"--sweep-size {args.sweep_size}: guidellm's sweep needs at least 2 (synchronous and throughput)")
    return args


def model_id(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as reply:
        return str(json.load(reply)["data"][0]["id"])


@contextlib.contextmanager
def specmesh_http(args: argparse.Namespace) -> Iterator[str]:
    """The preset's stack with its HTTP API; yields the base URL."""
    target, draft = PRESETS[args.preset]
    base = free_port_block(4)
    stack = Stack(StackConfig(target=target, draft=draft, gateway_port=base, verifier_port=base + 1,
                              draft_port=base + 2, http_port=base + 3, num_threads=args.threads,
                              extra_env=parse_env(args.env)))
    log(f"starting the {args.preset} stack, HTTP on {base + 3}")
    stack.start()
    log(warm_up(stack.config.gateway_addr))          # as `specmesh up` does; llama-server warms up at load
    try:
        yield f"http://127.0.0.1:{base + 3}"
    finally:
        stack.stop()


def prefetch(max_requests: int) -> int:
    """Prompts guidellm's data worker makes ahead of demand: a few more than a benchmark sends. Its default, 4,096
    synthetic prompts, kept a core busy for ~5 s at the start of each benchmark, on the server's 2 cores (the first
    synchronous request: forwards 54-60 ms against 38, 70 ms a token against the others' 40-44)."""
    return max(16, 2 * max_requests)


def sweep(args: argparse.Namespace, base_url: str, model: str, report: Path) -> dict[str, Any]:
    """guidellm's sweep against `base_url`; its JSON report."""
    tokenizer = resolve_model_dir(PRESETS[args.preset][0])
    cmd = [args.guidellm, "run", "--backend", f"kind=openai_http,target={base_url},model={model}",
           "--profile", f"kind=sweep,sweep_size={args.sweep_size},strategy_type=poisson",
           "--constraint", f"kind=max_requests,count={args.max_requests}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
           "--data-loader", f"kind=pytorch,prefetch_factor={prefetch(args.max_requests)}",
           "--output", f"kind=json,path={report}", "--disable-console"]
    log(f"guidellm sweep against {base_url}")
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=report.parent, stdout=subprocess.DEVNULL)
    log(f"... {time.perf_counter() - started:.0f} s")
    return dict(json.loads(report.read_text()))


def _stat(metrics: dict[str, Any], name: str, key: str) -> float:
    stats = metrics.get(name, {}).get("successful", {})
    if key in ("mean", "median"):
        return float(stats.get(key) or 0.0)
    return float((stats.get("percentiles") or {}).get(key) or 0.0)


def summary(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per benchmark of a guidellm report."""
    rows = []
    for bench in report.get("benchmarks", []):
        m = bench["metrics"]
        rows.append({
            "strategy": bench.get("config", {}).get("strategy", {}).get("type_", ""),
            "requests_per_s": _stat(m, "requests_per_second", "mean"),
            "output_tok_s": _stat(m, "output_tokens_per_second", "mean"),
            "ttft_ms_p50": _stat(m, "time_to_first_token_ms", "median"),
            "ttft_ms_p99": _stat(m, "time_to_first_token_ms", "p99"),
            "itl_ms_p50": _stat(m, "inter_token_latency_ms", "median"),
            "itl_ms_p99": _stat(m, "inter_token_latency_ms", "p99"),
            "requests": m.get("request_totals", {}),
        })
    return rows


def print_table(results: dict[str, list[dict[str, Any]]]) -> None:
    print(f"\n{'server':<14}{'benchmark':<14}{'req/s':>7}{'out tok/s':>11}{'TTFT p50/p99 ms':>18}"
          f"{'ITL p50/p99 ms':>17}{'done/err':>10}")
    for server, rows in results.items():
        for r in rows:
            totals = r["requests"]
            print(f"{server:<14}{r['strategy']:<14}{r['requests_per_s']:>7.3f}{r['output_tok_s']:>11.2f}"
                  f"{r['ttft_ms_p50']:>9.0f}/{r['ttft_ms_p99']:<8.0f}{r['itl_ms_p50']:>8.0f}/{r['itl_ms_p99']:<8.0f}"
                  f"{totals.get('successful', 0):>5}/{totals.get('errored', 0)}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path(args.guidellm).is_file():
        raise SystemExit(f"{args.guidellm} not found: `make load-tools` builds it")
    json_path, _ = result_paths(args.name)
    work = json_path.parent / f"{json_path.stem}-guidellm"
    work.mkdir(parents=True, exist_ok=True)
    reports: dict[str, dict[str, Any]] = {}
    for target in split_csv(args.targets):
        if target == "specmesh":
            with specmesh_http(args) as url:
                reports[target] = sweep(args, url, model_id(url), work / "specmesh.json")
        elif target == "llama-server":
            server, gguf = find_server(args.llama_server), target_gguf(args.preset)
            if not server or gguf is None:
                log("llama-server skipped: no binary (--llama-server) or no GGUF file (`specmesh models fetch`)")
                continue
            with running_server(server, gguf, args.peer_threads) as url:
                reports[target] = sweep(args, url, model_id(url), work / "llama-server.json")
        else:
            raise SystemExit(f"unknown target {target!r}: choose from {', '.join(TARGETS)}")
    results = {server: summary(report) for server, report in reports.items()}
    print_table(results)
    write_json(json_path, {"meta": run_metadata(args), "summary": results, "reports": reports})
    return 0


if __name__ == "__main__":
    sys.exit(main())
