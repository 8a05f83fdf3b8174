"""Int4 weights on huge pages against the same weights on 4 KiB pages: the verifier's forward, arms alternating in
one process (the same model object, the same KV slots), so the machine's drift falls on both.

    .venv/bin/python -m bench.huge_pages --preset qwen2.5-coder-1.5b            # ~2 min, ~4 GB RAM
    .venv/bin/python -m bench.huge_pages --preset tiny-target --rounds 2 --reps 3     # smoke run

Arms: `huge`: the int4 weights and the KV cache as the engine builds them (specmesh/engine/huge_pages.py: mappings
advised MADV_HUGEPAGE); `plain`: the same bytes cloned into ordinary allocations. A long --context shows the KV
cache's part (a decode step reads the whole context's KV in every layer). Each round times both arms (order
alternating) at every k: the median ms of --reps forwards of k new tokens after a --context-token context. Reports
per k the median over rounds of each arm and of the per-round ratio plain / huge, the host's THP mode and how much
of the process's memory the kernel gave as huge pages. The numbers are identical in both arms (same bytes); the run
checks the logits. Writes bench/results/huge-pages-<preset>-<time>.json.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.common import result_paths, run_metadata, split_csv, write_json
from bench.forward_arms import add_arm_args, alternate, context_ids, int4_parts, print_rows, ratio_rows
from specmesh.engine.huge_pages import huge_page_copies, thp_mode
from specmesh.engine.int4_linear import int4_weights_to_huge_pages, replace_int4_weights
from specmesh.engine.paged_attention import PagedKVCache

SMAPS = Path("/proc/self/smaps_rollup")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arm_args(p, rounds=5)
    return p.parse_args(argv)


def to_huge_pages(model: torch.nn.Module, cache: PagedKVCache) -> None:
    """The int4 weights and the KV cache copied into mappings advised for huge pages (as the engine builds them)."""
    int4_weights_to_huge_pages(model)
    caches = huge_page_copies([t for pair in zip(cache.key_caches, cache.value_caches, strict=True) for t in pair])
    cache.key_caches, cache.value_caches = caches[0::2], caches[1::2]


def to_plain_pages(model: torch.nn.Module, cache: PagedKVCache) -> None:
    """The int4 weights and the KV cache cloned into ordinary allocations (4 KiB pages where THP is "madvise")."""
    cache.key_caches = [t.clone() for t in cache.key_caches]
    cache.value_caches = [t.clone() for t in cache.value_caches]
    replace_int4_weights(model, lambda tensors: [t.clone() for t in tensors])


def anon_huge_mib() -> float:
    """MiB of this process's anonymous memory on huge pages (0 where the kernel does not say)."""
    try:
        for line in SMAPS.read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ks = [int(k) for k in split_csv(args.ks)]
    parts = int4_parts(args, ks)
    model, runner = parts.loaded.model, parts.runner
    context = context_ids(args.context)
    huge_mib: dict[str, float] = {}

    def arm(name: str, move: Callable[[torch.nn.Module, PagedKVCache], None]) -> Callable[[], None]:
        def set_up() -> None:
            move(model, runner.cache)
            huge_mib[name] = anon_huge_mib()
        return set_up
    times = alternate({"huge": arm("huge", to_huge_pages), "plain": arm("plain", to_plain_pages)}, runner, context,
                      ks, args.rounds, args.reps)
    rows = ratio_rows(times, "plain", "huge")
    print(f"{args.preset} int4, {args.threads} threads, THP mode {thp_mode() or 'none'}; AnonHugePages "
          f"{huge_mib['huge']:.0f} MiB with the huge arm's weights, {huge_mib['plain']:.0f} MiB with the plain's")
    print_rows(rows, "plain", "huge", args.rounds)
    path, _ = result_paths(args.name or f"huge-pages-{args.preset}")
    write_json(path, {"meta": run_metadata(args), "thp_mode": thp_mode(), "anon_huge_mib": huge_mib,
                      "rows": {str(k): row for k, row in rows.items()},
                      "times_ms": {arm: {str(k): v for k, v in by_k.items()} for arm, by_k in times.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
