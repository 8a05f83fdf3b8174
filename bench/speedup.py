"""Does speculation pay? Every arm in one run, on the same models and numerics:

  stack (one verifier + one draft service, the draft link through a WAN-emulating proxy, bench/wan_proxy.py;
  the model arms use a fixed draft length k and draft prefetch):
    target    target-only decoding through the stack (num_draft_tokens=0)
    model     speculative, draft model only (n-gram and cache tiers off)
    tiers     speculative, all tiers: draft cache (one tenant per prompt, so repeated FAQ asks hit it), n-gram, model
    adaptive  speculative, draft model only, adaptive draft length (at most --adaptive-max-k)
    no-prefetch  the model arm without draft prefetch (the next block is asked for after each verify)
    head-32k  the model arm with a second draft service drafting from a 32768-token LM head (only with --arms)
    ARM@rttN  the --rtt-arms again with N ms of round trip on the draft link (--rtts)
  in-process transformers (after the stack is stopped, --hf-threads threads, same dtype as the verifier):
    hf-target, hf-assisted (assistant_model=draft), hf-lookup (prompt_lookup_num_tokens), hf-draft (the draft alone)

    .venv/bin/python -m bench.speedup --preset tiny --limit 1 --max-new-tokens 32          # ~2 min
    .venv/bin/python -m bench.speedup --preset qwen --env SPECMESH_VERIFIER_DTYPE=int8 \\
        --env SPECMESH_DRAFT_DTYPE=int8 --max-new-tokens 64

Every stack output must equal the stack's target-only output token for token (failures: `!!!`, exit code 1).
Whether transformers' assisted / lookup output equals its own target-only output is reported per prompt (it is not
exact with int8 linears: its multi-token attention is not batch-invariant).
Writes bench/results/speedup-*.json and a PNG with speedup per category, acceptance per draft position and
speedup vs RTT. The analytic bound (1-a^(g+1))/((1-a)(g c+1)) uses the measured per-token acceptance a of the
model arm, g = --num-draft-tokens and c = draft/target time per token measured in-process (hf-draft vs hf-target).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

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
    result_paths,
    run_metadata,
    split_csv,
    timed_request,
    write_json,
)
from bench.speedup_plot import plot, print_report
from bench.speedup_stats import analytic_speedup, hf_summary, prompt_id, summarize_arm
from bench.wan_proxy import WanProxy
from specmesh.launcher import PRESETS, Stack, StackConfig

HF_MODES = ("target", "draft", "assisted", "lookup")
# Every gateway starts from BASE_ENV (draft model only, fixed k, prefetch on); an arm with its own settings gets its
# own gateway on the same verifier and draft service.
BASE_ENV = {"SPECMESH_GATEWAY_ENABLE_NGRAM": "0", "SPECMESH_GATEWAY_ENABLE_CACHE": "0",
            "SPECMESH_GATEWAY_ADAPTIVE_DRAFT_LENGTH": "0", "SPECMESH_GATEWAY_DRAFT_PREFETCH": "1"}
ARM_ENV: dict[str, dict[str, str]] = {
    "target": {}, "model": {},
    "tiers": {"SPECMESH_GATEWAY_ENABLE_NGRAM": "1", "SPECMESH_GATEWAY_ENABLE_CACHE": "1"},
    "adaptive": {"SPECMESH_GATEWAY_ADAPTIVE_DRAFT_LENGTH": "1"},
    "no-prefetch": {"SPECMESH_GATEWAY_DRAFT_PREFETCH": "0"},
    "head-32k": {},
}
# Arms with a draft service of their own (same model, other settings), reached through a proxy of their own.
ARM_DRAFT_ENV: dict[str, dict[str, str]] = {"head-32k": {"SPECMESH_DRAFT_HEAD_VOCAB": "32768"}}
STACK_ARMS = tuple(ARM_ENV)
DEFAULT_ARMS = ("target", "model", "tiers", "adaptive", "no-prefetch")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--threads", type=int, default=1, help="torch threads per model service")
    p.add_argument("--verifier-threads", type=int, default=0, help="torch threads of the verifier (0 = --threads)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="service environment")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=4, help="k of the model and tiers arms")
    p.add_argument("--adaptive-max-k", type=int, default=6, help="the adaptive arm's request k (its upper bound)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help=f"stack arms to run (target is always run), from {','.join(STACK_ARMS)}")
    p.add_argument("--rtts", default="0,20,40,80", help="draft-link round trips (ms) of the RTT sweep")
    p.add_argument("--rtt-arms", default="model,no-prefetch", help="arms run again at each RTT")
    p.add_argument("--rtt-limit", type=int, default=1, help="prompts per category in the RTT sweep (0 = all)")
    p.add_argument("--bandwidth-mbps", type=float, default=0.0, help="draft-link bandwidth (0 = unlimited)")
    p.add_argument("--hf-modes", default=",".join(HF_MODES), help="in-process transformers modes ('' = none)")
    p.add_argument("--hf-threads", type=int, default=2, help="torch threads of the in-process transformers runs")
    p.add_argument("--hf-dtype", default="", help="float32 or int8 (default: the verifier's SPECMESH_VERIFIER_DTYPE)")
    p.add_argument("--name", default="", help="result file prefix (default speedup-<preset>)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------- stack arms
async def run_arm(arm: str, addr: str, prompt: Prompt, args: argparse.Namespace) -> list[RequestResult]:
    """One arm on one prompt; the tiers arm asks repeated (FAQ) prompts `repeat` times under one tenant."""
    k = {"target": 0, "adaptive": args.adaptive_max_k}.get(arm, args.num_draft_tokens)
    asks = prompt.repeat if arm == "tiers" else 1
    tenant = fresh_tenant()
    out = []
    for ask in range(asks):
        ask_prompt = prompt if asks == 1 else Prompt(f"{prompt.id}#{ask}", prompt.category, prompt.prompt,
                                                     prompt.system, prompt.repeat)
        out.append(await timed_request(addr, make_request(ask_prompt, args.max_new_tokens, k), ask_prompt, arm,
                                       tenant))
    return out


Results = dict[str, list[RequestResult]]   # per arm ("model@rtt40" etc. for the sweep)


async def stack_phase(args: argparse.Namespace, prompts: list[Prompt]) -> tuple[Results, list[str]]:
    """Results per arm, and the prompt ids of the RTT sweep."""
    arms = ["target"] + [a for a in split_csv(args.arms) if a != "target"]
    unknown = set(arms) - set(STACK_ARMS)
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}; choose from {STACK_ARMS}")
    # gateway, verifier, draft, proxy; per arm: a gateway, and a draft service + its proxy where the arm has one
    base = free_port_block(4 + 3 * len(arms))
    target, draft = PRESETS[args.preset]
    proxy = WanProxy(base + 3, f"127.0.0.1:{base + 2}", bandwidth_bps=args.bandwidth_mbps * 1e6 / 8)
    await proxy.start()
    stack = Stack(StackConfig(target=target, draft=draft, gateway_port=base, verifier_port=base + 1,
                              draft_port=base + 2, num_threads=args.threads, verifier_threads=args.verifier_threads,
                              draft_link_addr=proxy.address, extra_env={**parse_env(args.env), **BASE_ENV}))
    proxies: list[WanProxy] = []
    log(f"starting {args.preset} stack ({target} + {draft}), draft link via {proxy.address}")
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
        return await run_stack_arms(args, prompts, arms, addrs, proxy)
    finally:
        await asyncio.to_thread(stack.stop)
        for p in (proxy, *proxies):
            await p.stop()


async def run_stack_arms(args: argparse.Namespace, prompts: list[Prompt], arms: list[str], addrs: dict[str, str],
                         proxy: WanProxy) -> tuple[Results, list[str]]:
    warm = argparse.Namespace(**{**vars(args), "max_new_tokens": min(8, args.max_new_tokens)})
    for arm in arms:                                     # first-call allocations and connections, not recorded
        await run_arm(arm, addrs[arm], Prompt("warmup", "warmup", prompts[0].prompt, prompts[0].system), warm)
    results: Results = {arm: [] for arm in arms}
    for i, prompt in enumerate(prompts):
        order = arms[i % len(arms):] + arms[:i % len(arms)]   # rotate, so no arm always runs first or last
        line = []
        for arm in order:
            rs = await run_arm(arm, addrs[arm], prompt, args)
            results[arm] += rs
            line.append(f"{arm} {rs[-1].decode_tok_s:5.2f}" + (f" a={rs[-1].acceptance_rate:.2f}" if arm != "target"
                                                               else ""))
        log(f"{prompt.id:<22} decode tok/s: " + " | ".join(line))
    rtts = [float(r) for r in split_csv(args.rtts) if float(r) > 0]
    sweep = [p for p in prompts if args.rtt_limit == 0
             or sum(q.category == p.category for q in prompts[:prompts.index(p) + 1]) <= args.rtt_limit]
    rtt_arms = [a for a in split_csv(args.rtt_arms) if a in arms and a != "target"]
    for rtt in rtts:
        proxy.latency_ms = rtt / 2
        for i, prompt in enumerate(sweep):
            for arm in rtt_arms[i % len(rtt_arms):] + rtt_arms[:i % len(rtt_arms)]:
                rs = await run_arm(arm, addrs[arm], prompt, args)
                for r in rs:
                    r.mode = f"{arm}@rtt{rtt:g}"
                results.setdefault(f"{arm}@rtt{rtt:g}", []).extend(rs)
                log(f"{prompt.id:<22} {arm} at rtt {rtt:g} ms: decode {rs[-1].decode_tok_s:.2f} tok/s")
    proxy.latency_ms = 0.0
    return results, [p.id for p in sweep]


# ------------------------------------------------------------------------------------------------- transformers
def hf_phase(args: argparse.Namespace, prompts: list[Prompt], dtype: str) -> list[dict[str, Any]]:
    """transformers' generate() in this process on the same models (and int8 linears if dtype is int8)."""
    modes = split_csv(args.hf_modes)
    if not modes:
        return []
    import torch

    from bench import compare_hf
    from specmesh.engine.int8_linear import quantize_linears
    from specmesh.models import load_model

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.hf_threads)
    target_ref, draft_ref = PRESETS[args.preset]
    target, draft = load_model(target_ref), load_model(draft_ref)
    if dtype == "int8":
        quantize_linears(target.model)
        quantize_linears(draft.model)
    knobs = argparse.Namespace(assistant_tokens=0, prompt_lookup_tokens=10)
    compare_hf.timed_generate(target, compare_hf.encode(target, prompts[0]), 2)      # warm-up
    runs = []
    for prompt in prompts:
        ids = compare_hf.encode(target, prompt)
        reference: list[int] = []
        for mode in ["target"] + [m for m in modes if m != "target"]:
            model = draft if mode == "draft" else target
            kwargs = {} if mode == "draft" else compare_hf.generate_kwargs(mode, draft, knobs)
            tokens, seconds = compare_hf.timed_generate(model, ids, args.max_new_tokens, **kwargs)
            reference = tokens if mode == "target" else reference
            same = mode in ("target", "draft") or tokens == reference
            runs.append({"prompt_id": prompt.id, "category": prompt.category, "mode": mode,
                         "new_tokens": len(tokens), "seconds": seconds, "matches_target": same,
                         "mismatch_at": -1 if same else first_mismatch(reference, tokens), "token_ids": tokens})
        log(f"{prompt.id:<22} hf tok/s: " + " | ".join(
            f"{r['mode']} {r['new_tokens'] / r['seconds']:.2f}" for r in runs if r["prompt_id"] == prompt.id))
    return runs


# ------------------------------------------------------------------------------------------------- checks, report
def check(results: Results) -> list[dict[str, Any]]:
    """Errors and greedy mismatches of every stack arm against the stack's target-only output."""
    target = {r.id: r for r in results["target"]}
    problems = []
    for arm, rs in results.items():
        for r in rs:
            t = target.get(prompt_id(r))
            if r.error:
                problems.append({"arm": arm, "id": r.id, "error": r.error})
            elif t is not None and arm != "target" and (at := first_mismatch(t.token_ids, r.token_ids)) >= 0:
                problems.append({"arm": arm, "id": r.id, "mismatch_at": at})
    for p in problems:
        print(f"!!! {p['arm']} {p['id']}: {p.get('error') or 'GREEDY MISMATCH at ' + str(p['mismatch_at'])}",
              file=sys.stderr)
    return problems


def bound(summary: dict[str, Any], hf: dict[str, Any], g: int) -> dict[str, Any]:
    """Measured model-arm speedup against the analytic bound for its measured a and the in-process c."""
    if "model" not in summary or "target" not in hf or "draft" not in hf:
        return {}
    a = summary["model"]["overall"]["pooled_acceptance"]
    c = hf["target"]["overall"]["tok_s"] / hf["draft"]["overall"]["tok_s"] if hf["draft"]["overall"]["tok_s"] else 0
    limit = analytic_speedup(a, g, c)
    measured = summary["model"]["overall"]["speedup"]["decode_median"]
    return {"a": a, "g": g, "c": c, "bound": limit, "measured_decode_median": measured,
            "fraction_of_bound": measured / limit if limit else 0.0}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    meta = run_metadata(args)
    env = parse_env(args.env)
    dtype = args.hf_dtype or env.get("SPECMESH_VERIFIER_DTYPE", "float32")
    prompts = load_workload(args.workload, split_csv(args.categories), True, args.limit)
    log(f"{len(prompts)} prompts, max_new_tokens {args.max_new_tokens}, k {args.num_draft_tokens}, dtype {dtype}")
    results, sweep_ids = asyncio.run(stack_phase(args, prompts))
    hf_runs = hf_phase(args, prompts, dtype)
    problems = check(results)
    for r in hf_runs:       # transformers' own speculation is only exact with batch-invariant numerics: reported
        if not r["matches_target"]:
            log(f"transformers {r['mode']} {r['prompt_id']}: differs from transformers target-only at token "
                f"{r['mismatch_at']}")
    target = {r.id: r for r in results["target"]}
    max_k = max(args.num_draft_tokens, args.adaptive_max_k)
    summary = {arm: summarize_arm(rs, target, max_k) for arm, rs in results.items()}
    for arm in split_csv(args.rtt_arms):
        if arm in results and any(key.startswith(f"{arm}@rtt") for key in results):
            at_zero = [r for r in results[arm] if r.id in sweep_ids]
            summary[f"{arm}@rtt0"] = summarize_arm(at_zero, target, max_k)
    hf = hf_summary(hf_runs)
    report = {"meta": meta, "hf_dtype": dtype, "summary": summary, "hf": hf,
              "analytic": bound(summary, hf, args.num_draft_tokens), "problems": problems,
              "requests": {arm: [r.to_json() for r in rs] for arm, rs in results.items()}, "hf_runs": hf_runs}
    print_report(report)
    json_path, png_path = result_paths(args.name or f"speedup-{args.preset}")
    write_json(json_path, report)
    plot(report, png_path, f"{args.preset} ({dtype}), k={args.num_draft_tokens}, {args.max_new_tokens} tokens, "
                           f"{len(prompts)} prompts")
    if problems:
        print(f"!!! {len(problems)} problem(s), see above", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
