"""Does speculation pay? Every arm and every peer in one run, on the same models, numerics and prompts (issue 14).

  stack arms (one verifier + one draft service, the draft link through a WAN-emulating proxy, bench/wan_proxy.py;
  fixed draft length k; each arm with settings of its own gets its own gateway on the same services):
    target      target-only decoding through the stack (num_draft_tokens=0)
    defaults    the gateway as it ships (its own tiers, adaptive k and prefetch; requests leave k to it)
    sequential  draft model only, no prefetch: k draft steps, then one verify (SPECMESH_GATEWAY_DRAFT_PREFETCH=0)
    overlap     sequential + SPECMESH_GATEWAY_OVERLAP=1 (drafting overlapped with verification)
    tree        sequential + SPECMESH_GATEWAY_DRAFT_TREE_WIDTH=2 (token trees)
    suffix      sequential + SPECMESH_GATEWAY_SUFFIX_DRAFTING=1 (the suffix-tree proposer)
    all         sequential + the three above
    (older arms, by --arms: model = prefetch on, tiers, adaptive, no-prefetch, head-32k)
  An arm whose GatewayConfig field is missing (its feature has not landed) is not run: reported as n/a.
  layouts (--layouts): a = two hosts simulated, verifier pinned to core 0 and draft service to core 1
    (`taskset -c`), target-only = the verifier alone on its core; b = one 2-core host, nothing pinned,
    verifier 2 threads (target-only uses both cores).
  peers (after the stacks are stopped): transformers in this process at --hf-threads (target, draft alone,
    assisted generation, prompt lookup); llama.cpp's llama-server on the same pair's GGUF files, target-only and
    with the draft at its default length, at each layout's thread count (bench/llamacpp_peer.py).

    .venv/bin/python -m bench.speedup --preset tiny --limit 2 --max-new-tokens 16          # ~3 min
    .venv/bin/python -m bench.speedup --preset qwen --env SPECMESH_VERIFIER_DTYPE=int8 \\
        --env SPECMESH_DRAFT_DTYPE=int8 --lengths 64,256 --long-limit 1 --long-categories chat,code,code-edit \\
        --long-arms all --b-arms target,sequential,all --max-repeats 2 --peer-lengths 64 --hf-limit 1   # 16 min here

Every stack output must equal the same layout's target-only output token for token (failures: `!!!`, exit code 1).
The tuning and the held-out evaluation prompts (the workload's `split`) are also reported apart, per category and
overall, with issue 23's goals for the `defaults` arm (bench/speedup_split.py).
Whether the peers' speculative outputs equal their own target-only outputs is reported. Writes
bench/results/speedup-*.json and a PNG (speedup per category per arm, layouts side by side; tok/s vs peers), prints
a table with ratios and one PASS/FAIL line per issue-14 goal with the term of the round model that limits it
(bench/speedup_goals.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench import llamacpp_peer
from bench.common import (
    Prompt,
    RequestResult,
    add_workload_args,
    first_mismatch,
    free_port_block,
    fresh_tenant,
    load_workload,
    log,
    make_request,
    parse_env,
    resolve_path,
    result_paths,
    run_metadata,
    split_arg,
    split_csv,
    timed_request,
    write_json,
)
from bench.hf_peer import HF_MODES, hf_phase, hf_summaries
from bench.speedup_arms import (
    ARM_DRAFT_ENV,
    ARM_ENV,
    BASE_ENV,
    DEFAULT_ARMS,
    LAYOUTS,
    REPEAT_ARMS,
    STACK_ARMS,
    Layout,
    arm_k,
    gateway_fields,
    layout_arms,
    prompt_cap,
    run_key,
)
from bench.speedup_goals import all_goals, format_goal
from bench.speedup_plot import plot, print_report
from bench.speedup_split import print_split_report, split_goals, summarize_splits
from bench.speedup_stats import analytic_bound, prompt_id, summarize_arm
from bench.wan_proxy import WanProxy
from gateway.verify_cost import VerifyCost
from specmesh.config import AUTO_DTYPE
from specmesh.engine.dtype_choice import resolve_dtype
from specmesh.ops.cores import cpu_list
from specmesh.ops.launcher import PRESETS, Stack, StackConfig

Results = dict[str, list[RequestResult]]   # per arm ("model@rtt40" etc. for the sweep)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--long-limit", type=int, default=0,
                   help="prompts per category at lengths above the shortest (0 = --limit)")
    p.add_argument("--long-categories", default="", help="categories at lengths above the shortest ('' = all)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--layouts", default="a,b", help=f"from {','.join(LAYOUTS)}")
    p.add_argument("--lengths", default="64,256", help="max_new_tokens values")
    p.add_argument("--max-new-tokens", type=int, default=0, help="one length (overrides --lengths)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="service environment")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="k of the speculative arms")
    p.add_argument("--adaptive-max-k", type=int, default=6, help="the adaptive arm's request k (its upper bound)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help=f"stack arms to run (target is always run), from {','.join(STACK_ARMS)}")
    p.add_argument("--b-arms", default="", help="arms of layout b ('' = --arms)")
    p.add_argument("--long-arms", default="", help="arms at lengths above the shortest ('' = all of the layout's)")
    p.add_argument("--max-repeats", type=int, default=0,
                   help="asks of a repeated (FAQ) prompt in the suffix/all/tiers arms (0 = the workload's repeat)")
    p.add_argument("--rtts", default="", help="draft-link round trips (ms) of an RTT sweep ('' = none)")
    p.add_argument("--rtt-arms", default="sequential", help="arms run again at each RTT")
    p.add_argument("--rtt-limit", type=int, default=1, help="prompts per category in the RTT sweep (0 = all)")
    p.add_argument("--bandwidth-mbps", type=float, default=0.0, help="draft-link bandwidth (0 = unlimited)")
    p.add_argument("--hf-modes", default=",".join(HF_MODES), help="in-process transformers modes ('' = none)")
    p.add_argument("--hf-threads", default="1,2", help="torch thread counts of the in-process transformers runs")
    p.add_argument("--hf-limit", type=int, default=0,
                   help="prompts per category of the transformers peer (0 = as the stack arms)")
    p.add_argument("--peer-lengths", default="", help="lengths the peers run at ('' = all of --lengths)")
    p.add_argument("--hf-dtype", default="",
                   help="float32, int8, int4 or auto (default: the verifier's SPECMESH_VERIFIER_DTYPE, else auto)")
    p.add_argument("--llamacpp", default="auto", help="llama-server binary, 'auto' ($SPECMESH_LLAMA_SERVER, "
                                                      "else llama-server on PATH; skipped if neither) or 'off'")
    p.add_argument("--llamacpp-draft-max", type=int, default=0, help="--spec-draft-n-max (0 = llama.cpp default)")
    p.add_argument("--verify-token-cost", type=float, default=0.1,
                   help="verify cost of one extra token in target steps, for the goal breakdown (~15/150 ms on CPU)")
    p.add_argument("--verify-free-tokens", type=int, default=1,
                   help="verified tokens that cost about one (the int4 kernel's row tile: 4 on AVX2, 8 on VNNI)")
    p.add_argument("--streams-json", default="",
                   help="a bench.concurrency result: its 8-stream / 1-stream speculative ratio joins the goals")
    p.add_argument("--name", default="", help="result file prefix (default speedup-<preset>)")
    args = p.parse_args(argv)
    args.length_list = [args.max_new_tokens] if args.max_new_tokens else [int(x) for x in split_csv(args.lengths)]
    args.peer_length_list = [int(x) for x in split_csv(args.peer_lengths)] or args.length_list
    return args


def peer_prompts(prompts: dict[int, list[Prompt]], args: argparse.Namespace, limit: int = 0) -> dict[int, list[Prompt]]:
    """The stack's prompts at the peers' lengths, at most `limit` per category (0 = all of them)."""
    out = {}
    for length in args.peer_length_list:
        selected = prompts.get(length) or select_prompts(args, length)
        out[length] = [p for i, p in enumerate(selected)
                       if not limit or sum(q.category == p.category for q in selected[:i + 1]) <= limit]
    return out


def prompts_by_length(args: argparse.Namespace) -> dict[int, list[Prompt]]:
    return {n: select_prompts(args, n) for n in args.length_list}


def select_prompts(args: argparse.Namespace, length: int) -> list[Prompt]:
    """The workload prompts at one length: --categories / --limit, or --long-categories / --long-limit above
    the shortest length."""
    longer = length > min(args.length_list)
    categories = split_csv(args.long_categories if longer and args.long_categories else args.categories)
    return load_workload(args.workload, categories, True,
                         prompt_cap(length, args.length_list, args.limit, args.long_limit), split_arg(args))


# ------------------------------------------------------------------------------------------------- stack arms
async def run_arm(arm: str, addr: str, prompt: Prompt, max_new_tokens: int,
                  args: argparse.Namespace) -> list[RequestResult]:
    """One arm on one prompt; the REPEAT_ARMS ask repeated (FAQ) prompts `repeat` times under one tenant."""
    k = arm_k(arm, args.num_draft_tokens, args.adaptive_max_k)
    asks = prompt.repeat if arm in REPEAT_ARMS else 1
    asks = min(asks, args.max_repeats) if args.max_repeats else asks
    tenant = fresh_tenant()
    out = []
    for ask in range(asks):
        ask_prompt = prompt if asks == 1 else dataclasses.replace(prompt, id=f"{prompt.id}#{ask}")
        out.append(await timed_request(addr, make_request(ask_prompt, max_new_tokens, k), ask_prompt, arm, tenant))
    return out


async def stack_phase(args: argparse.Namespace, layout: Layout, arms: list[str],
                      prompts: dict[int, list[Prompt]]) -> tuple[dict[str, Results], list[str]]:
    """Results per run key (layout/length) and arm, and the prompt ids of the RTT sweep."""
    # gateway, verifier, draft, proxy; per arm: a gateway, and a draft service + its proxy where the arm has one
    base = free_port_block(4 + 3 * len(arms))
    target, draft = PRESETS[args.preset]
    proxy = WanProxy(base + 3, f"127.0.0.1:{base + 2}", bandwidth_bps=args.bandwidth_mbps * 1e6 / 8)
    await proxy.start()
    gateways = ["gateway", *(f"gateway-{arm}" for arm in arms)]
    others = {name: layout.others_cpus for name in gateways if layout.others_cpus}
    stack = Stack(StackConfig(target=target, draft=draft, gateway_port=base, verifier_port=base + 1,
                              draft_port=base + 2, num_threads=layout.draft_threads,
                              verifier_threads=layout.verifier_threads, draft_link_addr=proxy.address,
                              extra_env={**parse_env(args.env), **BASE_ENV}, taskset={**dict(layout.pin), **others},
                              nice=dict(layout.nice)))
    own_cpus = os.sched_getaffinity(0)
    if layout.others_cpus:                   # this process: the client and the WAN proxy
        os.sched_setaffinity(0, cpu_list(layout.others_cpus))
    proxies: list[WanProxy] = []
    log(f"layout {layout.name}: starting {args.preset} stack ({target} + {draft}), {layout.description}")
    try:
        started = time.perf_counter()
        await asyncio.to_thread(stack.start)
        addrs = {}
        for i, arm in enumerate(arms):
            port = base + 4 + 3 * i
            draft_link = None
            if arm in ARM_DRAFT_ENV:
                own = await asyncio.to_thread(stack.add_draft, f"draft-{arm}", port + 1, ARM_DRAFT_ENV[arm])
                proxies.append(await WanProxy(port + 2, own).start())
                draft_link = proxies[-1].address
            addrs[arm] = stack.config.gateway_addr if not (ARM_ENV[arm] or draft_link) else await asyncio.to_thread(
                stack.add_gateway, f"gateway-{arm}", port, ARM_ENV[arm], draft_addr=draft_link)
        log(f"stack up in {time.perf_counter() - started:.0f} s")
        return await run_stack_arms(args, layout.name, prompts, arms, addrs, proxy)
    finally:
        await asyncio.to_thread(stack.stop)
        for p in (proxy, *proxies):
            await p.stop()
        os.sched_setaffinity(0, own_cpus)


async def run_stack_arms(args: argparse.Namespace, layout: str, prompts: dict[int, list[Prompt]], arms: list[str],
                         addrs: dict[str, str], proxy: WanProxy) -> tuple[dict[str, Results], list[str]]:
    first = next(iter(prompts.values()))[0]
    for arm in arms:                                     # first-call allocations and connections, not recorded
        await run_arm(arm, addrs[arm], Prompt("warmup", "warmup", first.prompt, first.system), 8, args)
    by_key: dict[str, Results] = {}
    for length, selected in prompts.items():
        here = [a for a in arms if a == "target" or not args.long_arms or length == min(prompts)
                or a in split_csv(args.long_arms)]
        results: Results = by_key.setdefault(run_key(layout, length), {arm: [] for arm in here})
        for i, prompt in enumerate(selected):
            order = here[i % len(here):] + here[:i % len(here)]   # rotate, so no arm always runs first or last
            line = []
            for arm in order:
                rs = await run_arm(arm, addrs[arm], prompt, length, args)
                results[arm] += rs
                line.append(f"{arm} {rs[-1].decode_tok_s:5.2f}"
                            + (f" a={rs[-1].acceptance_rate:.2f}" if arm != "target" else ""))
            log(f"{layout}/{length} {prompt.id:<20} decode tok/s: " + " | ".join(line))
    length = args.length_list[0]
    rtts = [float(r) for r in split_csv(args.rtts) if float(r) > 0]
    selected = prompts[length]
    sweep = [p for p in selected if args.rtt_limit == 0
             or sum(q.category == p.category for q in selected[:selected.index(p) + 1]) <= args.rtt_limit]
    rtt_arms = [a for a in split_csv(args.rtt_arms) if a in arms and a != "target"]
    results = by_key[run_key(layout, length)]
    for rtt in rtts if rtt_arms else []:
        proxy.latency_ms = rtt / 2
        for i, prompt in enumerate(sweep):
            for arm in rtt_arms[i % len(rtt_arms):] + rtt_arms[:i % len(rtt_arms)]:
                rs = await run_arm(arm, addrs[arm], prompt, length, args)
                for r in rs:
                    r.mode = f"{arm}@rtt{rtt:g}"
                results.setdefault(f"{arm}@rtt{rtt:g}", []).extend(rs)
                log(f"{prompt.id:<22} {arm} at rtt {rtt:g} ms: decode {rs[-1].decode_tok_s:.2f} tok/s")
    proxy.latency_ms = 0.0
    return by_key, [p.id for p in sweep]


def cost_ratio(hf: dict[str, Any], layouts: list[Layout], summary: dict[str, Any]) -> dict[str, float]:
    """c per layout: draft time per token (in-process, at the layout's draft threads) / target time per token,
    the layout's own target-only arm (decode median at the shortest length; the unit of the goals' round model),
    or the in-process target at the verifier's threads when the stack has none."""
    out = {}
    for layout in layouts:
        d = next((s for k, s in hf.items() if k.endswith(f"/t{layout.draft_threads}") and "draft" in s), None)
        keys = sorted((k for k in summary if k.startswith(f"{layout.name}/")), key=lambda k: int(k.split("/")[1]))
        stack = summary[keys[0]]["target"]["overall"].get("median_decode_tok_s", 0.0) if keys else 0.0
        t = next((s for k, s in hf.items() if k.endswith(f"/t{layout.verifier_threads}") and "target" in s), None)
        target_tok_s = stack or (t["target"]["overall"]["tok_s"] if t else 0.0)
        if d and d["draft"]["overall"]["tok_s"] and target_tok_s:
            out[layout.name] = target_tok_s / d["draft"]["overall"]["tok_s"]
    return out


# ------------------------------------------------------------------------------------------------- checks, report
def check(runs: dict[str, Results]) -> list[dict[str, Any]]:
    """Errors and greedy mismatches of every stack arm against the same run's target-only output."""
    problems = []
    for key, results in runs.items():
        target = {r.id: r for r in results["target"]}
        for arm, rs in results.items():
            for r in rs:
                t = target.get(prompt_id(r))
                if r.error:
                    problems.append({"run": key, "arm": arm, "id": r.id, "error": r.error})
                elif t is not None and arm != "target" and (at := first_mismatch(t.token_ids, r.token_ids)) >= 0:
                    problems.append({"run": key, "arm": arm, "id": r.id, "mismatch_at": at})
    for p in problems:
        print(f"!!! {p['run']} {p['arm']} {p['id']}: "
              f"{p.get('error') or 'GREEDY MISMATCH at ' + str(p['mismatch_at'])}", file=sys.stderr)
    return problems


def streams_section(path: str) -> dict[str, Any]:
    """8-stream / 1-stream aggregate tok/s of the speculative mode from a bench.concurrency result."""
    if not path:
        return {}
    rows = json.loads(resolve_path(path).read_text())["throughput"]
    spec = {r["streams"]: r["aggregate_tok_s"] for r in rows if r["mode"] == "spec"}
    if 1 not in spec or 8 not in spec:
        return {}
    return {"ratio": spec[8] / spec[1], "one": spec[1], "eight": spec[8], "source": path,
            "note": f"1 stream {spec[1]:.2f} tok/s, 8 streams {spec[8]:.2f}"}


def summarize_runs(runs: dict[str, Results], max_k: int) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for key, results in runs.items():
        target = {r.id: r for r in results["target"]}
        summary[key] = {arm: summarize_arm(rs, target, max_k) for arm, rs in results.items()}
    return summary


def concurrency_command(args: argparse.Namespace) -> str:
    env = " ".join(f"--env {e}" for e in args.env)
    return (f".venv/bin/python -m bench.concurrency --start-stack --preset {args.preset} {env} --only throughput "
            f"--streams 1,8 --max-new-tokens {args.length_list[0]}").replace("  ", " ")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    meta = run_metadata(args)
    env = parse_env(args.env)
    requested = args.hf_dtype or env.get("SPECMESH_VERIFIER_DTYPE", AUTO_DTYPE)
    dtype = resolve_dtype(requested, PRESETS[args.preset][0]).dtype  # as the verifier resolves it
    prompts = prompts_by_length(args)
    layouts = [LAYOUTS[name] for name in split_csv(args.layouts)]
    log(f"prompts per length {({n: len(p) for n, p in prompts.items()})}, k {args.num_draft_tokens}, dtype {dtype}, "
        f"layouts {[lay.name for lay in layouts]}")
    fields = gateway_fields()
    runs: dict[str, Results] = {}
    not_run: dict[str, dict[str, list[str]]] = {}
    for layout in layouts:
        arms, na = layout_arms(split_csv(args.b_arms if layout.name == "b" and args.b_arms else args.arms), fields)
        not_run[layout.name] = na
        for arm, missing in na.items():
            log(f"layout {layout.name}: arm {arm} n/a (GatewayConfig lacks {', '.join(missing)}): not run")
        by_key, _ = asyncio.run(stack_phase(args, layout, arms, prompts))
        runs |= by_key
    hf_runs = hf_phase(args, peer_prompts(prompts, args, args.hf_limit), dtype)
    server = "" if args.llamacpp == "off" else llamacpp_peer.server_path("" if args.llamacpp == "auto"
                                                                          else args.llamacpp)
    all_prompts = list({p.id: p for selected in prompts.values() for p in selected}.values())
    at_peer = peer_prompts(prompts, args)
    peer_all = list({p.id: p for selected in at_peer.values() for p in selected}.values())
    peer = {"skipped": "--llamacpp off"} if args.llamacpp == "off" else llamacpp_peer.run_peer(
        server, args.preset, peer_all, args.peer_length_list, sorted({lay.peer_threads for lay in layouts}),
        args.llamacpp_draft_max)
    if "runs" in peer:      # the peer ran every prompt at every length; keep each length's own selection
        keep = {(p.id, n) for n, selected in at_peer.items() for p in selected}
        peer["runs"] = [r for r in peer["runs"] if (r["prompt_id"], r["max_tokens"]) in keep]
        peer["summary"] = llamacpp_peer.summarize([llamacpp_peer.PeerRun(**r) for r in peer["runs"]])
    problems = check(runs)
    for r in hf_runs:       # transformers' own speculation is only exact with batch-invariant numerics: reported
        if not r["matches_target"]:
            log(f"transformers {r['mode']} t{r['threads']} @{r['max_new_tokens']} {r['prompt_id']}: differs from "
                f"transformers target-only at token {r['mismatch_at']}")
    summary = summarize_runs(runs, max(args.num_draft_tokens, args.adaptive_max_k))
    splits = summarize_splits(runs, {p.id: p.split for p in all_prompts}, max(args.num_draft_tokens,
                                                                               args.adaptive_max_k))
    hf = hf_summaries(hf_runs)
    c_of = cost_ratio(hf, layouts, summary)
    report = {"meta": meta, "hf_dtype": dtype, "layouts": {lay.name: lay.description for lay in layouts},
              "not_run": not_run, "summary": summary, "hf": hf, "cost_ratio": c_of, "llamacpp": peer,
              "analytic": {key: analytic_bound(s, c_of.get(key.split("/")[0], 0.0), args.num_draft_tokens, arm)
                           for key, s in summary.items() for arm in ["sequential"] if arm in s},
              "streams": streams_section(args.streams_json), "concurrency_command": concurrency_command(args),
              "problems": problems, "splits": splits,
              "requests": {key: {arm: [r.to_json() for r in rs] for arm, rs in results.items()}
                           for key, results in runs.items()}, "hf_runs": hf_runs}
    verify = VerifyCost(args.verify_token_cost, args.verify_free_tokens)
    report["goals"], report["split_goals"] = all_goals(report, verify), split_goals(splits, c_of, verify)
    print_report(report)
    print("\ngoals (issue 14):")
    for goal in report["goals"]:
        print(format_goal(goal))
    print_split_report(splits, report["split_goals"])
    if not report["streams"]:
        print(f"8-stream aggregate vs 1 stream: not in this run; measure with `{report['concurrency_command']}` "
              f"and pass its JSON as --streams-json")
    json_path, png_path = result_paths(args.name or f"speedup-{args.preset}")
    write_json(json_path, report)
    plot(report, png_path, f"{args.preset} ({dtype}), k={args.num_draft_tokens}, lengths "
                           f"{','.join(map(str, args.length_list))}, {len(all_prompts)} prompts")
    if problems:
        print(f"!!! {len(problems)} problem(s), see above", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
