"""The int4 kernel's thread pool when it shares its cores: ms per verifier forward at 2 kernel threads on a 2-core
host, alone and beside busy processes that stand for the draft service (one busy core each), for each kernel source
given. Forwards of the kernels alternate within each repetition, so load drift hits them alike (a ratio in one run).

    .venv/bin/python -m bench.pool_contention                                   # this tree's kernel only, ~2 min
    git show <rev>:specmesh/engine/int4_kernel.c > /tmp/old_kernel.c
    .venv/bin/python -m bench.pool_contention --kernels new=specmesh/engine/int4_kernel.c,old=/tmp/old_kernel.c

Prints a table (median and p90 ms per forward) and writes bench/results/pool-contention-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.common import REPO_ROOT, RESULTS_DIR, log, split_csv
from bench.quantized_forward import BLOCK, CONTEXT
from specmesh.config import EngineConfig
from specmesh.engine import int4_kernel
from specmesh.engine.build import build_engine_parts
from specmesh.engine.cpu_build import load
from specmesh.engine.int4_linear import Int4GroupLinear
from specmesh.engine.model_runner import ForwardItem, ModelRunner

BUSY_LOOP = "while True: pass"


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes spinning on a core each (what a drafting service does to a shared host)."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        time.sleep(0.5 if procs else 0.0)
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def load_kernels(spec: str) -> dict[str, object]:
    """name=path pairs -> loaded libraries (the same signature as int4_kernel.library())."""
    libs = {}
    for pair in split_csv(spec):
        name, _, path = pair.partition("=")
        source = Path(path) if Path(path).is_absolute() else REPO_ROOT / path
        lib = load(source)
        lib.sm_int4_linear.argtypes = int4_kernel.library().sm_int4_linear.argtypes
        lib.sm_int4_linear.restype = None
        libs[name] = lib
    return libs


def use_kernel(runner: ModelRunner, lib: object) -> None:
    for module in runner.model.modules():
        if isinstance(module, Int4GroupLinear):
            module.lib = lib


def time_forward(runner: ModelRunner, context: list[int], k: int) -> float:
    table = list(range(-(-(len(context) + k) // BLOCK)))
    start = time.perf_counter()
    runner.forward([ForwardItem(context[:k], len(context), table, k)])
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-coder-1.5b")
    p.add_argument("--kernels", default="current=specmesh/engine/int4_kernel.c", help="name=C source, comma list")
    p.add_argument("--busy", default="0,1", help="numbers of busy processes beside the forward")
    p.add_argument("--ks", default="1,4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=12)
    args = p.parse_args(argv)
    libs = load_kernels(args.kernels)
    parts = build_engine_parts(EngineConfig(model=args.preset, dtype="int4", num_kv_blocks=64, block_size=BLOCK))
    runner = parts.runner
    context = list(range(3, 3 + CONTEXT))
    runner.forward([ForwardItem(context, 0, list(range(-(-(CONTEXT + 16) // BLOCK))), 1)])
    torch.set_num_threads(args.threads)
    report: dict = {"preset": args.preset, "threads": args.threads, "kernels": args.kernels, "ms": {}}
    for busy in (int(b) for b in split_csv(args.busy)):
        with busy_processes(busy):
            for k in (int(k) for k in split_csv(args.ks)):
                times: dict[str, list[float]] = {name: [] for name in libs}
                for _ in range(args.reps):
                    for name, lib in libs.items():
                        use_kernel(runner, lib)
                        times[name].append(time_forward(runner, context, k))
                for name, ts in times.items():
                    ts.sort()
                    entry = {"median": statistics.median(ts), "p90": ts[int(0.9 * (len(ts) - 1))], "all": ts}
                    report["ms"][f"busy={busy}/k={k}/{name}"] = entry
                    log(f"busy {busy} k={k} {name:10} median {entry['median']:7.1f} ms  p90 {entry['p90']:7.1f} ms")
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"pool-contention-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
