"""Workload benchmark: target-only vs speculative decoding, A/B per prompt through the same stack.

    python -m bench.run_workload --start-stack --preset tiny
    python -m bench.run_workload --addr 127.0.0.1:50051 --limit 2 --max-new-tokens 48

Each prompt runs greedy twice in a row (target-only with num_draft_tokens=0, then speculative, the order
alternating between prompts); both outputs must be identical token for token. Writes JSON (and a PNG plot)
to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    Prompt,
    RequestResult,
    add_stack_args,
    add_workload_args,
    aggregate,
    first_mismatch,
    format_sources,
    fresh_tenant,
    load_workload,
    log,
    make_request,
    pyplot,
    result_paths,
    run_metadata,
    split_arg,
    split_csv,
    stack_addr,
    timed_request,
    write_json,
)

MODES = ("target", "spec")
Pair = dict[str, RequestResult]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    add_stack_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=4, help="draft length of the speculative runs")
    p.add_argument("--no-dedupe", dest="dedupe", action="store_false",
                   help="run repeated prompts (the FAQ category) as often as the workload says")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up requests")
    p.add_argument("--cache-scope", choices=["request", "run"], default="request",
                   help="draft-cache tenant: fresh per request (default), or one for the whole run so repeated "
                        "prompts (--no-dedupe) can draft from the cache")
    p.add_argument("--name", default="", help="result file prefix (default workload-<preset or addr>)")
    return p.parse_args(argv)


async def run_pair(addr: str, prompt: Prompt, args: argparse.Namespace, spec_first: bool, tenant: str = "") -> Pair:
    pair: Pair = {}
    for mode in (reversed(MODES) if spec_first else MODES):
        draft = args.num_draft_tokens if mode == "spec" else 0
        request = make_request(prompt, args.max_new_tokens, draft)
        pair[mode] = await timed_request(addr, request, prompt, mode, tenant)
    return pair


async def run_all(addr: str, prompts: list[Prompt], args: argparse.Namespace) -> list[Pair]:
    if args.warmup:
        log("warm-up (one short request per mode, not recorded)")
        warm = argparse.Namespace(**{**vars(args), "max_new_tokens": min(8, args.max_new_tokens)})
        await run_pair(addr, prompts[0], warm, spec_first=False)
    pairs = []
    tenant = fresh_tenant() if args.cache_scope == "run" else ""
    for i, prompt in enumerate(prompts):
        pair = await run_pair(addr, prompt, args, spec_first=i % 2 == 1, tenant=tenant)
        t, s = pair["target"], pair["spec"]
        log(f"{prompt.id:<22} target {t.completion_tokens:3d} tok {t.tok_s:6.2f} tok/s | spec "
            f"{s.completion_tokens:3d} tok {s.tok_s:6.2f} tok/s acc {s.acceptance_rate:.2f} "
            f"{s.mean_tokens_per_round:.2f} tok/round")
        pairs.append(pair)
    return pairs


def check_pairs(pairs: list[Pair]) -> list[dict[str, Any]]:
    """Failed requests and greedy mismatches between the two modes, each printed loudly."""
    problems = []
    for pair in pairs:
        t, s = pair["target"], pair["spec"]
        if t.error or s.error:
            problems.append({"id": t.id, "error": t.error or s.error})
        elif (at := first_mismatch(t.token_ids, s.token_ids)) >= 0:
            problems.append({"id": t.id, "mismatch_at": at, "target_tokens": len(t.token_ids),
                             "spec_tokens": len(s.token_ids), "target_text": t.text, "spec_text": s.text})
    for p in problems:
        print(f"!!! {p['id']}: " + (p.get("error") or f"GREEDY MISMATCH at token {p['mismatch_at']} "
              f"(target {p['target_tokens']} tokens, spec {p['spec_tokens']})"), file=sys.stderr)
    return problems


def summarize(pairs: list[Pair]) -> dict[str, dict[str, Any]]:
    """Per category and overall: both modes' aggregates and the speedup (median over prompts and aggregate)."""
    groups: dict[str, list[Pair]] = {}
    for pair in pairs:
        groups.setdefault(pair["target"].category, []).append(pair)
    groups["overall"] = pairs
    out = {}
    for name, group in groups.items():
        ok = [g for g in group if not (g["target"].error or g["spec"].error) and g["target"].tok_s > 0]
        modes = {m: aggregate(g[m] for g in ok) for m in MODES}
        speedups = [g["spec"].tok_s / g["target"].tok_s for g in ok]
        decode = [g["spec"].decode_tok_s / g["target"].decode_tok_s for g in ok if g["target"].decode_tok_s > 0]
        agg_t = modes["target"].get("aggregate_tok_s", 0.0)
        out[name] = {**modes, "n": len(group), "speedup_median": statistics.median(speedups) if speedups else 0.0,
                     "speedup_aggregate": modes["spec"].get("aggregate_tok_s", 0.0) / agg_t if agg_t else 0.0,
                     "decode_speedup_median": statistics.median(decode) if decode else 0.0, "speedups": speedups}
    return out


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    head = (f"{'category':<12}{'n':>3}{'target tok/s':>14}{'spec tok/s':>12}{'speedup med':>13}{'speedup agg':>13}"
            f"{'decode med':>12}{'accept':>8}{'tok/round':>11}{'TTFT t/s ms':>14}")
    print("\nmedian tok/s per request; agg = all tokens / all wall time; decode = after the first token\n"
          + head + "\n" + "-" * len(head))
    for name, row in summary.items():
        t, s = row["target"], row["spec"]
        if not t.get("n") or not s.get("n"):
            print(f"{name:<12}{row['n']:>3}  (no successful pairs)")
            continue
        ttft = f"{t['median_ttft_s'] * 1000:.0f}/{s['median_ttft_s'] * 1000:.0f}"
        print(f"{name:<12}{row['n']:>3}{t['median_tok_s']:>14.2f}{s['median_tok_s']:>12.2f}"
              f"{row['speedup_median']:>12.2f}x{row['speedup_aggregate']:>12.2f}x{row['decode_speedup_median']:>11.2f}x"
              f"{s['acceptance_rate']:>8.2f}"
              f"{s['mean_tokens_per_round']:>11.2f}{ttft:>14}")
    print("\ndraft sources of the speculative rounds (none = a round without a draft)")
    for name, row in summary.items():
        if row["spec"].get("n"):
            print(f"  {name:<12}{format_sources(row['spec']['sources'])}")


def plot(summary: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    rows = {k: v for k, v in summary.items() if v["target"].get("n") and v["spec"].get("n")}
    if plt is None or not rows:
        return
    names = list(rows)
    x = range(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for offset, mode in ((-0.2, "target"), (0.2, "spec")):
        ax1.bar([i + offset for i in x], [rows[n][mode]["aggregate_tok_s"] for n in names], 0.4, label=mode)
    for i, n in enumerate(names):
        top = max(rows[n][m]["aggregate_tok_s"] for m in MODES)
        ax1.annotate(f"{rows[n]['speedup_aggregate']:.2f}x", (i, top),
                     ha="center", va="bottom", fontsize=8)
    ax1.set(xticks=list(x), xticklabels=names, ylabel="tokens/s (aggregate)", title="throughput per request")
    ax1.legend()
    ax2.bar(x, [rows[n]["spec"]["acceptance_rate"] for n in names], 0.5, color="tab:green")
    ax2.set(xticks=list(x), xticklabels=names, ylim=(0, 1), ylabel="acceptance rate", title="draft acceptance")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    meta = run_metadata(args)
    prompts = load_workload(args.workload, split_csv(args.categories), args.dedupe, args.limit,
                            split_arg(args))
    log(f"{len(prompts)} prompts, max_new_tokens {args.max_new_tokens}, draft length {args.num_draft_tokens}")
    with stack_addr(args) as addr:
        pairs = asyncio.run(run_all(addr, prompts, args))
    problems = check_pairs(pairs)
    summary = summarize(pairs)
    print_table(summary)
    name = args.name or f"workload-{args.preset if args.start_stack else 'stack'}"
    json_path, png_path = result_paths(name)
    write_json(json_path, {"meta": meta, "summary": summary, "problems": problems,
                           "requests": [pair[m].to_json() for pair in pairs for m in MODES]})
    title = (f"{name}: {len(prompts)} prompts, max_new_tokens {args.max_new_tokens}, "
             f"k={args.num_draft_tokens}, greedy")
    plot(summary, png_path, title)
    if problems:
        print(f"!!! {len(problems)} problem(s): failed requests or greedy mismatches, see above", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
