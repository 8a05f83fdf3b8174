"""The batch-invariant attention kernel alone: ms per forward's attention (every layer) for a decode step of S streams,
each over a context of its own, against the per-row SDPA fallback on the same pool.

    .venv/bin/python -m bench.attention_kernel                       # Qwen2.5-1.5B geometry, ~1 min
    .venv/bin/python -m bench.attention_kernel --contexts 256,1024,4096 --streams 1,8

Shapes are the target's (28 layers, 12 query heads over 2 KV heads of 128): S streams decode one token each, stream s
over its own `context` keys in blocks of 16 slots of a pool as the verifier's ([slots, kvH, D] per layer, float32), or
with --shared-context all streams over the same keys (the cache-warm case: one stream verifying S tokens). Each
timing is the fastest of --reps calls over all layers (with several streams the pools far exceed the caches, so a
call reads keys and values from memory as a real decode step does). --kv-dtypes times the kernel over a float32 and
a float16 cache (`EngineConfig.kv_cache_dtype`) holding the same values, on --threads kernel threads. Prints a table
and writes bench/results/attention-kernel-*.json.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from bench.common import fastest_s, log, result_paths, run_metadata, split_csv, write_json
from specmesh.engine import attention_kernel

BLOCK = 16
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def column(name: str, dtype: str) -> str:
    """A row's key for a per-cache-type figure: `name` for float32 (the columns before --kv-dtypes), else suffixed."""
    return name if dtype == "float32" else f"{name}_{dtype}"


def pools(num_layers: int, num_slots: int, kv_heads: int, head_dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(num_slots, kv_heads, head_dim, generator=g), torch.randn(num_slots, kv_heads, head_dim,
                                                                                 generator=g))
            for _ in range(num_layers)]


def kernel_call(layers: list[tuple[torch.Tensor, torch.Tensor]], query: torch.Tensor,
                slots: list[torch.Tensor], threads: int = 1) -> Callable[[], None]:
    flat = torch.cat(slots).to(torch.int32)
    lengths = torch.tensor([len(s) for s in slots])
    starts, max_len, scale = torch.cumsum(lengths, 0) - lengths, int(lengths.max()), query.shape[-1] ** -0.5

    def run() -> None:
        for keys, values in layers:
            attention_kernel.paged_attention(query, keys, values, flat, starts, lengths, max_len, scale, threads)
    return run


def sdpa_call(layers: list[tuple[torch.Tensor, torch.Tensor]], query: torch.Tensor,
              slots: list[torch.Tensor]) -> Callable[[], None]:
    """The fallback's work: each row's keys gathered, then one 1-query SDPA row (GQA) per stream and layer."""
    def run() -> None:
        for keys, values in layers:
            for row, own in enumerate(slots):
                k, v = keys.index_select(0, own).transpose(0, 1), values.index_select(0, own).transpose(0, 1)
                F.scaled_dot_product_attention(query[row].unsqueeze(1), k, v, enable_gqa=True)
    return run


def measure(context: int, streams: int, args: argparse.Namespace) -> dict[str, float]:
    blocks = -(-context // BLOCK)
    layers = pools(args.layers, (1 if args.shared_context else streams) * blocks * BLOCK, args.kv_heads, args.head_dim)
    slots = [torch.arange(context) + (0 if args.shared_context else s * blocks * BLOCK) for s in range(streams)]
    query = torch.randn(streams, args.heads, args.head_dim)
    row: dict[str, float] = {"context": context, "streams": streams}
    kv_elements = args.layers * 2 * (1 if args.shared_context else streams) * context * args.kv_heads * args.head_dim
    for dtype in split_csv(args.kv_dtypes):
        cast = [(k.to(KV_DTYPES[dtype]), v.to(KV_DTYPES[dtype])) for k, v in layers]
        ms = fastest_s(kernel_call(cast, query, slots, args.threads), args.reps) * 1e3
        row[column("kernel_ms", dtype)] = ms
        row[column("kv_gb_s", dtype)] = kv_elements * KV_DTYPES[dtype].itemsize / ms / 1e6
    if args.sdpa:
        row["sdpa_ms"] = fastest_s(sdpa_call(layers, query, slots), args.reps) * 1e3
    return row


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="256,1024")
    p.add_argument("--streams", default="1,8")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--shared-context", action="store_true", help="every stream over the same keys")
    p.add_argument("--no-sdpa", dest="sdpa", action="store_false", help="skip the per-row SDPA fallback")
    p.add_argument("--kv-dtypes", default="float32", help="cache element types timed (float32, float16)")
    p.add_argument("--threads", type=int, default=1, help="the kernel's threads")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--name", default="attention-kernel")
    args = p.parse_args(argv)
    if not attention_kernel.supports(args.head_dim, torch.float32):
        print("the attention kernel cannot be built or run here", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    rows = []
    dtypes = split_csv(args.kv_dtypes)
    for context in (int(c) for c in split_csv(args.contexts)):
        for streams in (int(s) for s in split_csv(args.streams)):
            rows.append(measure(context, streams, args))
            r = rows[-1]
            timed = ", ".join(f"{d} {r[column('kernel_ms', d)]:7.2f} ms" for d in dtypes)
            log(f"context {context:>5} streams {streams:>2}: kernel {timed}"
                + (f", sdpa {r['sdpa_ms']:7.2f} ms" if "sdpa_ms" in r else ""))
    print(f"\nattention over {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, "
          f"{args.threads} kernel thread(s){', shared context' if args.shared_context else ''}")
    print(f"{'context':>8}{'streams':>8}" + "".join(f"{d + ' ms':>13}{'GB/s':>7}" for d in dtypes) + f"{'sdpa ms':>10}")
    for r in rows:
        cells = "".join(f"{r[column('kernel_ms', d)]:>13.2f}{r[column('kv_gb_s', d)]:>7.1f}" for d in dtypes)
        print(f"{r['context']:>8}{r['streams']:>8}{cells}{r.get('sdpa_ms', float('nan')):>10.2f}")
    json_path, _ = result_paths(args.name)
    write_json(json_path, {"meta": run_metadata(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
