"""Decode steps over long contexts with a float32 and a float16 KV cache (`EngineConfig.kv_cache_dtype`): ms per
forward, the two engines' forwards alternating in one process so the machine's drift falls on both.

    python -m bench.kv_cache_dtype                                   # 1.5B int4, 1 and 8 streams, 1k and 4k keys
    python -m bench.kv_cache_dtype --streams 8,16 --contexts 2000 --rounds 7
    python -m bench.kv_cache_dtype --streams 1 --contexts 1000 --agreement-tokens 1500 --reference-float32

S streams decode one token each, stream s over its own `context` cached tokens (its own blocks), in one forward:
the step of S users chatting over long documents. Each stream's decode row reads its whole context's keys and
values, so past a few thousand tokens the step is bound by that pass over the KV, which a half cache halves. The
cache is not prefilled (its zeros cost what real keys do: the kernels do not branch on values), so a 4k context
costs no 4k-token prefill. --agreement-tokens N: the two caches' top-1 choices over N tokens of workload text,
teacher-forced (prefilled in 256-token chunks), compared position by position, and with --reference-float32 each
against the float32 model on a float32 cache. Prints a table and writes bench/results/<name>-*.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from bench.common import log, result_paths, run_metadata, split_csv, write_json
from bench.quantized_forward import BLOCK, text_ids, top1
from specmesh.config import EngineConfig
from specmesh.engine.build import EngineParts, build_engine_parts
from specmesh.engine.model_runner import ForwardItem

KV_DTYPES = ("float32", "float16")
AGREEMENT_CHUNK = 256        # teacher-forced prefill chunk (logits of 256 rows at a time)


def engines(args: argparse.Namespace, num_blocks: int) -> dict[str, EngineParts]:
    return {d: build_engine_parts(EngineConfig(model=args.preset, dtype=args.dtype, num_kv_blocks=num_blocks,
                                               block_size=BLOCK, kv_cache_dtype=d, num_threads=args.threads))
            for d in KV_DTYPES}


def step_items(streams: int, context: int) -> list[ForwardItem]:
    """One decode row per stream at position `context`, over blocks of its own."""
    per_stream = -(-(context + 1) // BLOCK)
    return [ForwardItem([100 + s], context, list(range(s * per_stream, (s + 1) * per_stream)), 1)
            for s in range(streams)]


def measure(parts: dict[str, EngineParts], streams: int, context: int, args: argparse.Namespace) -> dict[str, float]:
    items = step_items(streams, context)
    times: dict[str, list[float]] = {d: [] for d in parts}
    for _ in range(args.rounds):
        for dtype, p in parts.items():
            p.runner.forward(items)                                    # settle (caches, pools) before timing
            for _ in range(args.reps):
                started = time.perf_counter()
                p.runner.forward(items)
                times[dtype].append(time.perf_counter() - started)
    row: dict[str, float] = {"streams": streams, "context": context}
    for dtype, ts in times.items():
        row[f"{dtype}_ms"] = statistics.median(ts) * 1e3
    row["speedup"] = row["float32_ms"] / row["float16_ms"]
    return row


def agreement(parts: dict[str, EngineParts], args: argparse.Namespace) -> dict[str, float]:
    """Top-1 agreement of the two caches, and with --reference-float32 of each with the float32 model."""
    ids = text_ids(parts["float32"].loaded.tokenizer, args.agreement_tokens)
    choices = {d: top1(p.runner, ids, AGREEMENT_CHUNK) for d, p in parts.items()}
    out = {"tokens": float(len(ids)),
           "float16_vs_float32_cache": float((choices["float16"] == choices["float32"]).float().mean())}
    if args.reference_float32:
        reference = top1(build_engine_parts(EngineConfig(model=args.preset, dtype="float32", kv_cache_dtype="float32",
                                                         num_kv_blocks=len(ids) // BLOCK + 2, block_size=BLOCK,
                                                         num_threads=args.threads)).runner, ids, AGREEMENT_CHUNK)
        for d, c in choices.items():
            out[f"{d}_cache_vs_float32_model"] = float((c == reference).float().mean())
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="int4", help="the model's numerics (the kernel's rowwise path: int4, int8)")
    p.add_argument("--streams", default="1,8")
    p.add_argument("--contexts", default="1000,4000")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="rounds of both engines, alternating")
    p.add_argument("--reps", type=int, default=5, help="forwards per engine and round (the median of all counts)")
    p.add_argument("--agreement-tokens", type=int, default=0, help="top-1 agreement over this many tokens (0 = skip)")
    p.add_argument("--reference-float32", action="store_true", help="... also against the float32 model")
    p.add_argument("--name", default="kv-cache-dtype")
    args = p.parse_args(argv)
    streams, contexts = [int(s) for s in split_csv(args.streams)], [int(c) for c in split_csv(args.contexts)]
    num_blocks = max(max(streams) * -(-(max(contexts) + 1) // BLOCK), args.agreement_tokens // BLOCK + 2)
    parts = engines(args, num_blocks)
    torch.set_num_threads(args.threads)
    rows = []
    for context in contexts:
        for s in streams:
            rows.append(measure(parts, s, context, args))
            r = rows[-1]
            log(f"{s:>2} stream(s) at {context:>5} tokens: float32 KV {r['float32_ms']:7.1f} ms, float16 KV "
                f"{r['float16_ms']:7.1f} ms a step ({r['speedup']:.2f}x)")
    print(f"\n{args.preset} {args.dtype}, {args.threads} threads: ms per decode step (one token per stream)")
    print(f"{'streams':>8}{'context':>9}{'float32':>10}{'float16':>10}{'speedup':>9}")
    for r in rows:
        print(f"{r['streams']:>8}{r['context']:>9}{r['float32_ms']:>10.1f}{r['float16_ms']:>10.1f}"
              f"{r['speedup']:>8.2f}x")
    agreed = agreement(parts, args) if args.agreement_tokens else {}
    if agreed:
        print(f"top-1 agreement over {int(agreed['tokens'])} tokens: " + ", ".join(
            f"{k} {v:.4f}" for k, v in agreed.items() if k != "tokens"))
    json_path, _ = result_paths(args.name)
    write_json(json_path, {"meta": run_metadata(args), "rows": rows, "agreement": agreed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
