"""Helpers shared by the benchmark scripts: the workload file, the stack, one timed request, result files."""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from gateway.tiers import TENANT_HEADER
from protos.specmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from specmesh.ops import client
from specmesh.ops.launcher import PRESETS, Stack, StackConfig
from specmesh.ops.warmup import warm_up

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOAD = str(REPO_ROOT / "bench" / "workload.jsonl")  # the repository's own copy, whatever the cwd
RESULTS_DIR = REPO_ROOT / "bench" / "results"
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
REQUEST_TIMEOUT_S = 3600.0
SPLITS = ("tune", "eval")   # prompts defaults are chosen on / held-out prompts they are judged on (bench/README.md)


# ------------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    prompt: str
    system: str = ""
    repeat: int = 1
    split: str = "tune"          # "tune" or "eval" (held out: other languages, tasks and chat styles)

    @property
    def messages(self) -> list[tuple[str, str]]:
        """Chat messages, so the gateway applies the target's chat template."""
        return ([("system", self.system)] if self.system else []) + [("user", self.prompt)]


def resolve_path(path: str) -> Path:
    """An absolute path as is; a relative one against the working directory, then the repository root."""
    candidates = [Path(path)] if Path(path).is_absolute() else [Path.cwd() / path, REPO_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"{path} not found (tried {', '.join(str(c) for c in candidates)})")


def load_workload(path: str, categories: Sequence[str] = (), dedupe: bool = True, limit: int = 0,
                  splits: Sequence[str] = ()) -> list[Prompt]:
    """Workload prompts in file order; `limit` caps distinct prompts per category within each split, `splits`
    selects "tune" and/or "eval" prompts (empty = both), `dedupe=False` expands each prompt's `repeat` count (ids
    get a `#k` suffix)."""
    prompts: list[Prompt] = []
    per_group: dict[tuple[str, str], int] = {}
    for line in resolve_path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        p = Prompt(row["id"], row["category"], row["prompt"], row.get("system", ""), int(row.get("repeat", 1)),
                   row.get("split", "tune"))
        if p.split not in SPLITS:
            raise SystemExit(f"{path}: prompt {p.id} has split {p.split!r}; choose from {', '.join(SPLITS)}")
        if (categories and p.category not in categories) or (splits and p.split not in splits):
            continue
        group = (p.split, p.category)
        if limit and per_group.get(group, 0) >= limit:
            continue
        per_group[group] = per_group.get(group, 0) + 1
        copies = 1 if dedupe else p.repeat
        prompts += [p if copies == 1 else replace(p, id=f"{p.id}#{k}") for k in range(copies)]
    if not prompts:
        raise SystemExit(f"no prompts selected from {path} (categories={list(categories) or 'all'}, "
                         f"splits={list(splits) or 'all'})")
    return prompts


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD,
                        help="workload JSONL (relative paths: working directory, then repository root)")
    parser.add_argument("--categories", default="", help="comma-separated categories to run (default: all)")
    parser.add_argument("--limit", type=int, default=0,
                        help="at most N distinct prompts per category and split (0 = all)")
    parser.add_argument("--split", default="", choices=["", *SPLITS],
                        help="only the tuning or the held-out evaluation prompts (default: both)")


def split_arg(args: argparse.Namespace) -> list[str]:
    """The splits `--split` selects ([] = both)."""
    return [args.split] if args.split else []


def split_csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


# ------------------------------------------------------------------------------------------------- the stack
def add_stack_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--addr", default="127.0.0.1:50051", help="gateway of a running stack")
    parser.add_argument("--start-stack", action="store_true", help="start verifier, draft and gateway here")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model pair for --start-stack")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per model service (--start-stack)")
    parser.add_argument("--port", type=int, default=0,
                        help="first of three ports for --start-stack (0 = random free ports >= 56000)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for --start-stack, e.g. SPECMESH_GATEWAY_ENABLE_NGRAM=0 (repeatable)")


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env wants KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _ports_free(base: int, count: int) -> bool:
    for port in range(base, base + count):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def bench_port_range() -> tuple[int, int]:
    """Ports for benchmark services: outside the kernel's ephemeral range, where the stack's own outgoing connections
    could take a port between its check and its bind (a gateway failed to bind that way), and away from the service
    defaults (50051-50062)."""
    try:
        eph_low, eph_high = (int(v) for v in EPHEMERAL_PORTS.read_text().split())
    except (OSError, ValueError):
        eph_low, eph_high = 32768, 60999
    if 65535 - eph_high >= 1000:
        return eph_high + 1, 65535
    return 20000, min(eph_low, 32000)


def free_port_block(count: int = 3) -> int:
    """First of `count` consecutive free ports in the bench range (never the service defaults)."""
    low, high = bench_port_range()
    for _ in range(200):
        base = random.randrange(low, high - count)
        if _ports_free(base, count):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in {low}..{high}")


@contextmanager
def stack_addr(args: argparse.Namespace, taskset: dict[str, str] | None = None) -> Iterator[str]:
    """The gateway address: `--addr`, or a stack started for the duration of the block (`taskset`: service -> cpu
    list each one is pinned to, as StackConfig.taskset)."""
    if not args.start_stack:
        yield args.addr
        return
    target, draft = PRESETS[args.preset]
    base = args.port or free_port_block()
    stack = Stack(StackConfig(target=target, draft=draft, gateway_port=base, verifier_port=base + 1,
                              draft_port=base + 2, num_threads=args.threads, extra_env=parse_env(args.env),
                              taskset=taskset or {}))
    log(f"starting {args.preset} stack ({target} + {draft}) on ports {base}..{base + 2}")
    started = time.perf_counter()
    stack.start()
    log(f"stack up in {time.perf_counter() - started:.0f} s: gateway {stack.config.gateway_addr}")
    log(warm_up(stack.config.gateway_addr))          # as `specmesh up` does (and llama-server at load)
    try:
        yield stack.config.gateway_addr
    finally:
        stack.stop()


# ------------------------------------------------------------------------------------------------- requests
@dataclass
class RequestResult:
    id: str
    category: str
    mode: str                    # "target" (num_draft_tokens=0) or "spec"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: float = 0.0          # until the first token arrived
    num_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    acceptance_rate: float = 0.0
    mean_tokens_per_round: float = 0.0
    undrafted_rounds: int = 0    # rounds without a draft (draft service fell back, or no room left)
    sources: dict[str, dict[str, int]] = field(default_factory=dict)  # per draft source: rounds/drafted/accepted
    round_log: list[tuple[int, int, str]] = field(default_factory=list)  # per round: drafted, accepted, source
    finish_reason: str = ""
    error: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""

    @property
    def tok_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first / time after the first: leaves out prefill (and prefix-cache hits on it)."""
        decode_s = self.wall_s - self.ttft_s
        return (self.completion_tokens - 1) / decode_s if self.completion_tokens > 1 and decode_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tok_s": self.tok_s, "decode_tok_s": self.decode_tok_s}


def make_request(prompt: Prompt, max_new_tokens: int, num_draft_tokens: int | None,
                 ignore_eos: bool = False) -> generate_pb2.GenerateRequest:
    """A greedy chat request for one workload prompt (num_draft_tokens None: the gateway's default)."""
    return client.make_request(messages=prompt.messages, max_new_tokens=max_new_tokens,
                               num_draft_tokens=num_draft_tokens, ignore_eos=ignore_eos)


def fresh_tenant() -> str:
    """A tenant nobody used before: the gateway's draft cache (scoped per tenant) starts empty for it."""
    return f"bench-{uuid.uuid4().hex[:12]}"


async def timed_request(addr: str, request: generate_pb2.GenerateRequest, prompt: Prompt, mode: str,
                        tenant: str = "") -> RequestResult:
    """Streams one generation and records timings, usage and draft sources; gRPC errors are recorded, not raised.

    `tenant` scopes the gateway's draft cache; empty = a fresh tenant, so earlier runs of the same prompt
    cannot serve drafts to this one."""
    result = RequestResult(prompt.id, prompt.category, mode)
    metadata = ((TENANT_HEADER, tenant or fresh_tenant()),)
    start = time.perf_counter()
    try:
        async with grpc.aio.insecure_channel(addr) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            async for response in stub.Generate(request, timeout=REQUEST_TIMEOUT_S, metadata=metadata):
                if response.token_ids and not result.token_ids:
                    result.ttft_s = time.perf_counter() - start
                result.token_ids.extend(response.token_ids)
                result.text += response.text
                _count_round(result, response.round)
                if response.HasField("usage"):
                    _copy_usage(result, response)
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    result.wall_s = time.perf_counter() - start
    return result


def _count_round(result: RequestResult, stats: generate_pb2.RoundStats) -> None:
    if stats.round == 0:  # the prefill's token
        return
    if stats.draft_source == common_pb2.DRAFT_SOURCE_NONE:
        result.undrafted_rounds += 1
    name = common_pb2.DraftSource.Name(stats.draft_source).removeprefix("DRAFT_SOURCE_").lower()
    result.round_log.append((stats.num_drafted, stats.num_accepted, name))
    counts = result.sources.setdefault(name, {"rounds": 0, "drafted": 0, "accepted": 0})
    counts["rounds"] += 1
    counts["drafted"] += stats.num_drafted
    counts["accepted"] += stats.num_accepted


def _copy_usage(result: RequestResult, response: generate_pb2.GenerateResponse) -> None:
    u = response.usage
    result.prompt_tokens, result.completion_tokens = u.prompt_tokens, u.completion_tokens
    result.num_rounds, result.num_drafted, result.num_accepted = u.num_rounds, u.num_drafted_tokens, \
        u.num_accepted_tokens
    result.acceptance_rate, result.mean_tokens_per_round = u.acceptance_rate, u.mean_tokens_per_round
    result.finish_reason = common_pb2.FinishReason.Name(response.finish_reason)


def aggregate(results: Iterable[RequestResult]) -> dict[str, float]:
    """Totals over requests: aggregate tok/s (all tokens / all wall time), medians, acceptance over all drafts."""
    rs = [r for r in results if not r.error]
    if not rs:
        return {"n": 0}
    tokens, wall = sum(r.completion_tokens for r in rs), sum(r.wall_s for r in rs)
    drafted, accepted, rounds = (sum(r.num_drafted for r in rs), sum(r.num_accepted for r in rs),
                                 sum(r.num_rounds for r in rs))
    return {
        "n": len(rs), "completion_tokens": tokens, "wall_s": wall,
        "aggregate_tok_s": tokens / wall if wall else 0.0,
        "median_tok_s": statistics.median(r.tok_s for r in rs),
        "median_decode_tok_s": statistics.median(r.decode_tok_s for r in rs),
        "median_ttft_s": statistics.median(r.ttft_s for r in rs),
        "num_rounds": rounds, "num_drafted": drafted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_tokens_per_round": (accepted + rounds) / rounds if rounds else 0.0,
        "undrafted_rounds": sum(r.undrafted_rounds for r in rs),
        "sources": merge_sources(r.sources for r in rs),
    }


def merge_sources(many: Iterable[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for sources in many:
        for name, counts in sources.items():
            into = total.setdefault(name, {"rounds": 0, "drafted": 0, "accepted": 0})
            for key, value in counts.items():
                into[key] += value
    return total


def format_sources(sources: dict[str, dict[str, int]]) -> str:
    """e.g. 'model 40 rounds 160 drafted 0.55 accepted, ngram ...' (rounds without drafts: 'none')."""
    parts = []
    for name, c in sorted(sources.items(), key=lambda kv: -kv[1]["rounds"]):
        rate = f", {c['accepted'] / c['drafted']:.2f} accepted" if c["drafted"] else ""
        parts.append(f"{name} {c['rounds']} rounds/{c['drafted']} drafted{rate}")
    return "; ".join(parts) or "-"


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token, or -1 when the sequences are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


# ------------------------------------------------------------------------------------------------- output
def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def fastest_s(fn: Callable[[], object], iters: int) -> float:
    """Seconds of the fastest of `iters` calls after one warm-up call (on a shared machine the minimum is the least
    noisy estimate of a call's own cost)."""
    fn()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def median_s(fn: Callable[[], object], iters: int, warmups: int = 1) -> float:
    """Seconds of the median of `iters` calls after `warmups` warm-up calls."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_metadata(args: argparse.Namespace) -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except OSError:
        commit = ""
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv, "args": vars(args),
            "git_commit": commit, "cpu_count": os.cpu_count(), "loadavg_at_start": os.getloadavg()}


def result_paths(name: str) -> tuple[Path, Path]:
    """(json, png) paths under bench/results/ for this run."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return stem.parent / f"{stem.name}.json", stem.parent / f"{stem.name}.png"    # names may hold dots (qwen2.5)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    payload["meta"]["loadavg_at_end"] = os.getloadavg()
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    log(f"wrote {path}")


def pyplot() -> Any | None:
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return None
    return plt
