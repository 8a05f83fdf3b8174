"""A long prompt beside a decoding stream: how long does the stream stall, and how much later is the prompt's first
token than alone? (issue 27's scenario, on a real stack)

    python -m bench.stall --start-stack --preset qwen --cpus-verifier 0 --cpus-draft 1
    python -m bench.stall --start-stack --preset tiny --prompt-tokens 600 --stream-tokens 120     # smoke run

Per configuration of the stream (`target`: num_draft_tokens 0; `spec`: the gateway's defaults):
1. alone: a document prompt of --prompt-tokens with nothing else running: its TTFT, and its own stream's gaps
   over --own-tokens (the first gap is where a round would wait for the draft service's prefill of the document);
2. beside: a stream decodes; after --warm-messages messages another document prompt of the same length (other
   text, so the prefix cache serves neither) arrives; the stream's median gap before it arrived, its longest gap
   while the prompt prefilled (send -> the prompt's first token), and the prompt's TTFT.
Goals (issue 27): longest gap <= 3x the median gap, TTFT beside <= 1.5x TTFT alone. The verifier's step bound is
its own setting (SPECMESH_VERIFIER_STEP_COST_FACTOR, passed with --env; the stack's default otherwise).
With --start-stack the verifier writes its step spans to the file --env SPECMESH_VERIFIER_TRACE_FILE names, else to
a temporary one, and each of the longest gaps gets the steps that ended in it (by wall clock): their duration, time
bound, prefill tokens and how long their threads waited for a core; the longest gap's step is logged. A step that
overran its bound while its threads waited for a core lost them to another task on the host, not to the schedule.
Writes bench/results/<name>-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from transformers import AutoTokenizer

from bench.common import add_stack_args, log, parse_env, result_paths, run_metadata, split_csv, stack_addr, write_json
from bench.serving_clients import StreamResult, grpc_sender
from bench.serving_mix import SUMMARIZE, TrafficRequest, document_ids, document_text
from specmesh.models import resolve_model_dir
from specmesh.ops.launcher import PRESETS

STREAM_K = {"target": 0, "spec": None}          # num_draft_tokens of the stream: 0 = target-only, None = defaults
STREAM_PROMPT = "Write a detailed, step-by-step tutorial on binary search trees in Python, with code."
MAX_GAP_RATIO, MAX_TTFT_RATIO = 3.0, 1.5
TRACE_ENV = "SPECMESH_VERIFIER_TRACE_FILE"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_args(p)
    p.add_argument("--configs", default="spec,target", help=f"stream configurations, of {', '.join(STREAM_K)}")
    p.add_argument("--prompt-tokens", type=int, default=3900, help="the long prompt's document tokens")
    p.add_argument("--stream-tokens", type=int, default=2000, help="the stream's max_tokens (it is cut when done)")
    p.add_argument("--warm-messages", type=int, default=40, help="stream messages before the long prompt arrives")
    p.add_argument("--cpus-verifier", default="", help="taskset -c list of the verifier ('' = unpinned)")
    p.add_argument("--cpus-draft", default="", help="taskset -c list of the draft service and the gateway")
    p.add_argument("--own-tokens", type=int, default=16, help="the prompt alone's max_tokens (its own gaps)")
    p.add_argument("--seed", type=int, default=0, help="picks the documents' offsets")
    p.add_argument("--name", default="")
    return p.parse_args(argv)


def documents(args: argparse.Namespace, count: int) -> list[TrafficRequest]:
    """`count` prompts of --prompt-tokens README tokens from distinct seeded offsets, ending in a summarize ask."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(PRESETS[args.preset][0]))
    ids, rng = document_ids(tokenizer), random.Random(args.seed)
    return [TrafficRequest(f"doc-{i}", "document", [("user", document_text(tokenizer, ids, args.prompt_tokens, rng)
                                                      + SUMMARIZE)], args.prompt_tokens, 1) for i in range(count)]


async def alone(send: Any, doc: TrafficRequest, num_tokens: int) -> dict[str, float]:
    """The prompt with nothing else running: its TTFT and its own stream's gaps (first, median, longest)."""
    result = StreamResult(doc.id, doc.kind, "alone", 0.0, num_tokens)
    await send(TrafficRequest(doc.id, doc.kind, doc.messages, doc.prompt_tokens, num_tokens), result)
    if result.error:
        raise RuntimeError(f"the prompt alone failed: {result.error}")
    gaps = [g for g, _ in result.gaps()] or [0.0]
    return {"ttft_alone_s": result.ttft_s, "own_first_gap_s": gaps[0], "own_median_gap_s": statistics.median(gaps),
            "own_longest_gap_s": max(gaps)}


async def beside(send: Any, doc: TrafficRequest, args: argparse.Namespace, config: str) -> dict[str, Any]:
    """The stream, the prompt sent after --warm-messages of its messages; the gaps and TTFT measured."""
    stream = StreamResult("stream", "chat", config, 0.0, args.stream_tokens)
    request = TrafficRequest("stream", "chat", [("user", STREAM_PROMPT)], 0, args.stream_tokens)
    stream_sent, stream_sent_epoch = time.perf_counter(), time.time()   # the sender's own clock starts here
    task = asyncio.ensure_future(send(request, stream))
    while len(stream.messages) < args.warm_messages and not task.done():
        await asyncio.sleep(0.005)
    arrived = len(stream.messages)
    prompt = StreamResult(doc.id, doc.kind, config, 0.0, 1)
    sent = time.perf_counter()
    await send(doc, prompt)
    done_at = time.perf_counter()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    before = [g for g, _ in stream.gaps()[: max(0, arrived - 1)]]
    window = (sent - stream_sent, done_at - stream_sent)                       # on the stream's clock
    times = [t for t, _ in stream.messages]
    spans = [(a, b) for a, b in zip(times, times[1:], strict=False) if b > window[0] and a < window[1]]
    during = [b - a for a, b in spans]
    longest = sorted(spans, key=lambda ab: ab[1] - ab[0])[-5:]       # where they fell: seconds after the prompt
    return {"ttft_s": prompt.ttft_s, "error": prompt.error or stream.error, "median_gap_s": statistics.median(before),
            "longest_gap_s": max(during, default=0.0), "stream_messages_during": len(during),
            "longest_gaps": [{"after_prompt_s": a - window[0], "gap_s": b - a,
                              "epoch_s": (stream_sent_epoch + a, stream_sent_epoch + b)} for a, b in reversed(longest)],
            "stream_tokens_per_message": stream.completion_tokens / max(1, len(stream.messages))}


async def run(addr: str, args: argparse.Namespace, docs: list[TrafficRequest]) -> list[dict[str, Any]]:
    rows = []
    for i, config in enumerate(split_csv(args.configs)):
        send, close = grpc_sender(addr, STREAM_K[config])
        try:
            await alone(send, docs[-1], 1)                                     # warm-up (kernels, first forward)
            row = {"config": config, **await alone(send, docs[2 * i], args.own_tokens)}
            row |= await beside(send, docs[2 * i + 1], args, config)
        finally:
            await close()
        row["gap_ratio"] = row["longest_gap_s"] / row["median_gap_s"]
        row["ttft_ratio"] = row["ttft_s"] / row["ttft_alone_s"]
        ok = not row["error"]                                                  # a failed prompt meets no goal
        row["goals"] = {"gap": ok and row["gap_ratio"] <= MAX_GAP_RATIO,
                        "ttft": ok and row["ttft_ratio"] <= MAX_TTFT_RATIO}
        log(f"{config}: median gap {row['median_gap_s'] * 1e3:.0f} ms, longest while the prompt prefilled "
            f"{row['longest_gap_s'] * 1e3:.0f} ms ({row['gap_ratio']:.1f}x, goal <= {MAX_GAP_RATIO}x); prompt TTFT "
            f"{row['ttft_s']:.1f} s beside vs {row['ttft_alone_s']:.1f} s alone ({row['ttft_ratio']:.2f}x, goal <= "
            f"{MAX_TTFT_RATIO}x); alone, its own stream's first gap {row['own_first_gap_s'] * 1e3:.0f} ms (median "
            f"{row['own_median_gap_s'] * 1e3:.0f} ms){'; ' + row['error'] if row['error'] else ''}")
        rows.append(row)
    return rows


def verifier_steps(trace_file: str) -> list[dict[str, float]]:
    """The verifier's forwards from its span file: start and end (epoch seconds), prefill tokens, time bound and
    the seconds its compute threads waited for a core (cpu_wait.py)."""
    steps = []
    with open(trace_file, encoding="utf-8") as f:
        for line in f:
            span = json.loads(line)
            if span.get("name") != "verifier-engine forward":
                continue
            a = span["attributes"]
            steps.append({"start_s": span["start_ns"] / 1e9, "end_s": span["end_ns"] / 1e9,
                          "prefill_tokens": a.get("specmesh.batch.num_prefill_tokens", 0),
                          "time_bound_s": a.get("specmesh.step.time_bound_s", 0.0),
                          "cpu_wait_s": a.get("specmesh.step.cpu_wait_s", 0.0)})
    return steps


def explain_longest_gaps(rows: list[dict[str, Any]], trace_file: str) -> None:
    """Puts on each of the longest gaps the verifier steps that ended inside it (the step that answered the message
    ending the gap, and any before it) and logs the longest: did its step overrun the bound, and was it for want of
    a core? A step's threads waiting for a core is the host's doing (another task on its cores), not the schedule."""
    try:
        steps = verifier_steps(trace_file)
    except OSError as exc:
        log(f"no verifier spans to explain the gaps ({exc})")
        return
    for row in rows:
        for gap in row["longest_gaps"]:
            begin, end = gap.pop("epoch_s")
            gap["steps"] = [{k: v for k, v in s.items() if k not in ("start_s", "end_s")} | {"seconds": s["end_s"] -
                            s["start_s"]} for s in steps if begin < s["end_s"] <= end]
        worst = row["longest_gaps"][0] if row["longest_gaps"] else None
        if worst and worst["steps"]:
            step = max(worst["steps"], key=lambda s: s["seconds"])
            log(f"{row['config']}: the longest gap's step ran {step['seconds'] * 1e3:.0f} ms (bound "
                f"{step['time_bound_s'] * 1e3:.0f} ms, {step['prefill_tokens']} prefill tokens); its threads waited "
                f"{step['cpu_wait_s'] * 1e3:.0f} ms for a core (other tasks on its cores)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    unknown = set(split_csv(args.configs)) - set(STREAM_K)
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(STREAM_K)}")
    meta = run_metadata(args)
    docs = documents(args, 2 * len(split_csv(args.configs)) + 1)
    pins = {k: v for k, v in (("verifier", args.cpus_verifier), ("draft", args.cpus_draft),
                              ("gateway", args.cpus_draft)) if v}
    with tempfile.TemporaryDirectory(prefix="specmesh-stall-") as trace_dir:
        trace_file = parse_env(args.env).get(TRACE_ENV, "") if args.start_stack else ""
        if args.start_stack and not trace_file:        # the verifier's step spans: what set the longest gaps
            trace_file = os.path.join(trace_dir, "verifier.jsonl")
            args.env.append(f"{TRACE_ENV}={trace_file}")
        with stack_addr(args, pins or None) as addr:
            rows = asyncio.run(run(addr, args, docs))
        if trace_file:                                  # (spans are flushed when the stack stops)
            explain_longest_gaps(rows, trace_file)
    json_path, _ = result_paths(args.name or f"stall-{args.preset}")
    write_json(json_path, {"meta": meta, "rows": rows})
    return 0 if all(not r["error"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
