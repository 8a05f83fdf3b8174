"""Soak test (a script, not a CI test): mixed real traffic while the draft service, Redis and the gateway are
SIGKILLed and restarted at random, for a fixed time.

    timeout 300 .venv/bin/python bench/soak.py --preset tiny --duration-s 60 --streams 4          # quick check
    .venv/bin/python bench/soak.py --preset tiny --duration-s 1200 --streams 8 --kill-every-s 30   # 20 min
    .venv/bin/python bench/soak.py --preset qwen --duration-s 600 --streams 4 --lease-s 30 --kill-every-s 45 \\
        --env SPECMESH_VERIFIER_DTYPE=int8 --env SPECMESH_DRAFT_DTYPE=int8                          # real pair

Every service is its own process on free ports (verifier, draft service, gateway, redis-server), /metrics on each.
Traffic (bench/soak_traffic.py): --streams concurrent clients, prompts whose length + max_new_tokens is within a few
tokens of --max-model-len (prefills chunked at --max-num-batched-tokens) beside short prompts; greedy and sampled;
num_draft_tokens 0..8; client cancels; short deadlines; two fixed greedy prompts re-asked that must give the same
tokens every time. Sessions left by a killed gateway are reclaimed by the session lease (--lease-s, passed as
SPECMESH_{VERIFIER,DRAFT}_SESSION_LEASE_S; ignored by services that have no lease).

Then the abuse scenarios run one after another (bench/soak_scenarios.py, --scenarios): session pinning by one
tenant over its stream limit, an overload burst, a verifier hung by SIGSTOP, a slow reader pausing for twice the
lease; each reports what it saw beside the outcomes, and its failures fail the run.

At the end traffic stops, the script waits until nothing is held (at most lease + --margin-s), then reports outcomes
by status code (INTERNAL/UNKNOWN must be zero), greedy checks, KV blocks and sessions still held on the verifier
(GetModelInfo) and the draft service (/metrics), RSS per service, Redis used_memory and kills per service; writes
bench/results/soak-<preset>-<timestamp>.json. Exit code 1 on any INTERNAL/UNKNOWN, leak or greedy difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log, parse_env, result_paths, run_metadata  # noqa: E402
from bench.soak_report import (  # noqa: E402
    GreedyChecks,
    Outcome,
    format_table,
    metric_samples,
    metric_value,
    rss_summary,
    tally,
    verdict,
)
from bench.soak_scenarios import API_KEYS, SCENARIOS, run_scenarios  # noqa: E402
from bench.soak_services import SoakServices, chaos, sample_every  # noqa: E402
from bench.soak_traffic import Mix, calibrate, worker  # noqa: E402
from specmesh.ops.launcher import PRESETS  # noqa: E402

EXPIRED_METRIC = "specmesh_sessions_expired_total"
KILLABLE = ("draft", "redis", "gateway")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--duration-s", type=float, default=60)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=512, help="context length of both models")
    p.add_argument("--max-num-batched-tokens", type=int, default=128, help="token budget per forward (chunking)")
    p.add_argument("--lease-s", type=float, default=10, help="session lease on verifier and draft service")
    p.add_argument("--margin-s", type=float, default=10, help="wait at most lease + this for held state to go")
    p.add_argument("--kill", default="draft,redis,gateway", help="services to SIGKILL and restart ('' = none)")
    p.add_argument("--kill-every-s", type=float, default=15, help="mean time between kills")
    p.add_argument("--long-frac", type=float, default=0.3, help="share of requests near the context limit")
    p.add_argument("--cancel-prob", type=float, default=0.15)
    p.add_argument("--deadline-prob", type=float, default=0.1, help="share of requests with a 0.2-3 s deadline")
    p.add_argument("--request-timeout-s", type=float, default=300)
    p.add_argument("--threads", type=int, default=1, help="torch threads per model service")
    p.add_argument("--no-redis", action="store_true")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the services, e.g. SPECMESH_VERIFIER_DTYPE=int8 (repeatable)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="abuse scenarios run after the traffic (bench/soak_scenarios.py; '' = none)")
    p.add_argument("--overload-streams", type=int, default=300, help="overload scenario: requests at once")
    p.add_argument("--hang-s", type=float, default=8, help="hung-verifier scenario: SIGSTOP this long")
    args = p.parse_args(argv)
    bad = set(filter(None, args.scenarios.split(","))) - set(SCENARIOS)
    if bad:
        p.error(f"--scenarios takes {','.join(SCENARIOS)}, not {','.join(sorted(bad))}")
    unknown = set(filter(None, args.kill.split(","))) - set(KILLABLE)
    if unknown:
        p.error(f"--kill takes {','.join(KILLABLE)}, not {','.join(sorted(unknown))}")
    return args


def service_env(args: argparse.Namespace) -> dict[str, str]:
    env: dict[str, str] = {"SPECMESH_GATEWAY_CACHE_SECRET": "soak",   # a restarted gateway reads the same keys
                           "SPECMESH_GATEWAY_API_KEYS": API_KEYS}     # tenants with quotas (the scenarios)
    for svc in ("VERIFIER", "DRAFT"):
        env[f"SPECMESH_{svc}_MAX_MODEL_LEN"] = str(args.max_model_len)
        env[f"SPECMESH_{svc}_MAX_NUM_BATCHED_TOKENS"] = str(args.max_num_batched_tokens)
        env[f"SPECMESH_{svc}_SESSION_LEASE_S"] = f"{args.lease_s:g}"
    return {**env, **parse_env(args.env)}


async def traffic(services: SoakServices, args: argparse.Namespace, mix: Mix, t0: float,
                  held: list[list[float]]) -> tuple[list[Outcome], GreedyChecks]:
    outcomes: list[Outcome] = []
    greedy = GreedyChecks()
    stop = asyncio.Event()
    targets = [t for t in args.kill.split(",") if t and (t != "redis" or services.redis is not None)]
    background = [asyncio.create_task(sample_every(services, 5.0, stop, t0, held))]
    if targets:
        background.append(asyncio.create_task(chaos(services, targets, args.kill_every_s, stop)))
    workers = [asyncio.create_task(worker(services.gateway_addr, mix, seed, stop, outcomes, greedy))
               for seed in range(args.streams)]
    await asyncio.sleep(args.duration_s)
    stop.set()
    log("traffic stopping: in-flight requests finish (at most 120 s), a restart in progress completes")
    _, pending = await asyncio.wait(workers, timeout=120)
    for task in pending:
        task.cancel()
    await asyncio.gather(*workers, *background, return_exceptions=True)
    return outcomes, greedy


async def held_state(services: SoakServices) -> dict[str, dict[str, int | None]]:
    info = await services.verifier_info()
    draft = services.metrics_text("draft")
    draft_sessions = metric_value(draft, "specmesh_engine_running_sessions")
    draft_blocks = metric_value(draft, "specmesh_kv_cache_blocks_used")
    return {"verifier": {"sessions": info.num_sessions, "kv_blocks": info.num_kv_blocks - info.num_free_kv_blocks},
            "draft": {"sessions": None if draft_sessions is None else int(draft_sessions),
                      "kv_blocks": None if draft_blocks is None else int(draft_blocks)}}


async def wait_released(services: SoakServices, limit_s: float) -> tuple[dict[str, dict[str, int | None]], float]:
    """Polls until nothing is held (or `limit_s` passed); returns the last reading and the seconds waited."""
    start = time.monotonic()
    while True:
        held = await held_state(services)
        waited = time.monotonic() - start
        if not any(v for counts in held.values() for v in counts.values()) or waited >= limit_s:
            return held, waited
        await asyncio.sleep(1.0)


def sessions_expired(services: SoakServices) -> dict[str, float | None]:
    return {svc: metric_value(services.metrics_text(svc), EXPIRED_METRIC) for svc in ("verifier", "draft")}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    use_redis = not args.no_redis and shutil.which("redis-server") is not None
    services = SoakServices(args.preset, service_env(args), args.threads, use_redis)
    services.start()
    try:
        mix = Mix(args.max_model_len, await calibrate(services.gateway_addr, args.max_model_len), args.long_frac,
                  cancel_prob=args.cancel_prob, deadline_prob=args.deadline_prob, timeout_s=args.request_timeout_s)
        log(f"traffic for {args.duration_s:.0f} s on {args.streams} streams; killing {args.kill or 'nothing'}")
        started = time.monotonic()
        held_timeline: list[list[float]] = []
        outcomes, greedy = await traffic(services, args, mix, started, held_timeline)
        ran_s = time.monotonic() - started
        names = [n for n in args.scenarios.split(",") if n]
        log(f"scenarios: {', '.join(names) or 'none'}")
        scenarios = await run_scenarios(services, args, names)
        held, waited = await wait_released(services, args.lease_s + args.margin_s)
        log(f"held state read after waiting {waited:.0f} s")
        services.sample_rss()
        redis_memory = services.redis.used_memory() if services.redis is not None else None
        expired = sessions_expired(services)
        gateway_errors = services.metrics_text("gateway")
    finally:
        services.stop()
    counts = tally(outcomes, [w for w in services.windows if w.service == "gateway"], started)
    return {"preset": args.preset, "duration_s": ran_s, "streams": args.streams, "outcomes": counts,
            "greedy_checks": greedy.to_json(), "held_at_end": held, "waited_for_release_s": round(waited, 1),
            "rss": {svc: rss_summary(s) for svc, s in services.rss_samples.items()},
            "redis_used_memory": redis_memory, "sessions_expired": expired,
            "gateway_request_errors_last_process": metric_samples(gateway_errors, "specmesh_request_errors_total"),
            "kills": dict(services.kills),
            # a killed gateway leaves at most one session per stream behind; more expiries mean a live one abandons
            # (and a verifier hung past the lease may have its sessions reaped on resume: the hung scenario's count)
            "sessions_expired_explained_by_kills": services.kills["gateway"] * args.streams
            + scenarios.get("hung", {}).get("sessions_expired", 0),
            "kill_windows": [[w.service, round(w.killed_s - started, 1), round(w.up_s - w.killed_s, 1)]
                             for w in services.windows],
            "verifier_timeline": {"columns": ["t_s", "sessions", "kv_blocks_used", "waiting"],
                                  "rows": held_timeline},
            "long_prompts": [vars(p) for p in mix.long_prompts],
            "scenarios": scenarios,
            "failures": verdict(counts, held, greedy) + [f for r in scenarios.values() for f in r["failures"]]}


def main() -> None:
    args = parse_args()
    result = asyncio.run(run(args))
    result["meta"] = run_metadata(args)
    path, _ = result_paths(f"soak-{args.preset}")
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(format_table(result))
    log(f"wrote {path}")
    sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
