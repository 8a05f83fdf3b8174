"""One thread pool for every C kernel library against a pool each: the verifier's forward, arms alternating in one
process (bench.forward_arms), so the machine's drift falls on both.

    .venv/bin/python -m bench.kernel_pool --preset qwen2.5-coder-1.5b            # ~2 min, ~4 GB RAM
    .venv/bin/python -m bench.kernel_pool --preset tiny-target --rounds 2 --reps 3     # smoke run

Arms: `shared` (the default, cpu_build.share_pools): the int4 and attention kernels run their jobs on one pool, one
worker a core beyond the caller's; `separate`: each library on its own pool, so each core beyond the caller's holds
two workers, the idle library's spinning while the other's job runs. Besides the forward's ms per k, each arm's
worker CPU seconds per forward are read from /proc (every thread of this process but the caller's). The numbers are
identical in both arms (checked). Writes bench/results/kernel-pool-<preset>-<time>.json.
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.common import result_paths, run_metadata, split_csv, write_json
from bench.forward_arms import add_arm_args, alternate, context_ids, int4_parts, print_rows, ratio_rows
from specmesh.engine import cpu_build

TASKS = Path("/proc/self/task")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arm_args(p, rounds=6)
    return p.parse_args(argv)


def other_threads_cpu_s() -> float:
    """CPU seconds of every thread of this process but the calling one (the pools' workers, torch's threads)."""
    own, total, tick = threading.get_native_id(), 0.0, os.sysconf("SC_CLK_TCK")
    for task in TASKS.iterdir():
        if int(task.name) == own:
            continue
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ks = [int(k) for k in split_csv(args.ks)]
    parts = int4_parts(args, ks)
    context = context_ids(args.context)
    worker_cpu_s = {"shared": 0.0, "separate": 0.0}
    last: list[tuple[str, float]] = []

    def arm(name: str) -> Callable[[], None]:
        def set_up() -> None:
            now = other_threads_cpu_s()
            if last:                       # the previous arm's worker CPU since it was set up
                worker_cpu_s[last[0][0]] += now - last[0][1]
            cpu_build.share_pools(name == "shared")
            last[:] = [(name, now)]
        return set_up
    times = alternate({"shared": arm("shared"), "separate": arm("separate")}, parts.runner, context, ks,
                      args.rounds, args.reps)
    worker_cpu_s[last[0][0]] += other_threads_cpu_s() - last[0][1]
    cpu_build.share_pools(True)
    rows = ratio_rows(times, "separate", "shared")
    forwards = args.rounds * len(ks) * (args.reps + 3)         # forward_ms: 1 + reps + 1, plus the logits check
    per_forward = {arm: s / forwards * 1e3 for arm, s in worker_cpu_s.items()}
    print(f"{args.preset} int4, {args.threads} threads; worker CPU per forward: shared {per_forward['shared']:.1f} ms,"
          f" separate {per_forward['separate']:.1f} ms")
    print_rows(rows, "separate", "shared", args.rounds)
    path, _ = result_paths(args.name or f"kernel-pool-{args.preset}")
    write_json(path, {"meta": run_metadata(args), "worker_cpu_ms_per_forward": per_forward,
                      "rows": {str(k): row for k, row in rows.items()},
                      "times_ms": {arm: {str(k): v for k, v in by_k.items()} for arm, by_k in times.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
