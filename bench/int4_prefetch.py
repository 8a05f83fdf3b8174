"""How fast the int4 kernel streams a decode's weights: this checkout's kernel against an earlier revision's.

    python -m bench.int4_prefetch --baseline-rev 9f2c1ab          # the kernel before the next-pair prefetch
    python -m bench.int4_prefetch --isa avx2 --rows 1,4

Builds `specmesh/engine/int4_kernel.c` as it is here and, with `--baseline-rev`, as it was in that git revision
(`git show REV:specmesh/engine/int4_kernel.c`, built beside it), then times passes of one batch of `rows` rows through
28 layers of the 1.5B target's MLP shapes (gate/up fused 1536 -> 17920, down 8960 -> 1536: 0.72 GB of int4 weights
in huge pages, far beyond any L3), the two kernels alternating pass by pass, on 1 and 2 threads. Prints ms a pass
and GB/s streamed, asserts the two kernels' outputs are bit-identical, and writes
bench/results/int4-prefetch-*.json. Random weights: the kernel's time does not depend on their values.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.common import log, split_csv
from specmesh.engine import int4_kernel
from specmesh.engine.cpu_build import AVX2_CFLAGS
from specmesh.engine.huge_pages import huge_page_copies
from specmesh.engine.int4_kernel import ISAS
from specmesh.engine.int4_linear import Int4GroupLinear

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "specmesh" / "engine" / "int4_kernel.c"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
LAYERS, HIDDEN, INTERMEDIATE = 28, 1536, 8960
Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]   # packed, scales, mins, k, n


def build(source: Path, out: Path, isa: str) -> ctypes.CDLL:
    subprocess.run(["gcc", *AVX2_CFLAGS, f"-I{SOURCE.parent}", str(source), "-o", str(out), "-lm"], check=True)
    lib = int4_kernel.declare(ctypes.CDLL(str(out)))
    if isa:
        got = lib.sm_set_isa(ISAS.index(isa))
        if ISAS[got] != isa:
            raise SystemExit(f"this CPU cannot run the {isa} path (it runs {ISAS[got]})")
    return lib


def mlp_layers() -> list[Layer]:
    torch.manual_seed(0)
    shapes = [Int4GroupLinear(nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False)),
              Int4GroupLinear(nn.Linear(INTERMEDIATE, HIDDEN, bias=False))]
    layers = [(s.packed, s.scales, s.mins, s.padded_in, s.padded_out) for _ in range(LAYERS) for s in shapes]
    flat = huge_page_copies([t for layer in layers for t in layer[:3]])      # distinct copies, as a model holds
    return [(flat[3 * i], flat[3 * i + 1], flat[3 * i + 2], k, n) for i, (_, _, _, k, n) in enumerate(layers)]


def one_pass(lib: ctypes.CDLL, layers: list[Layer], xs: dict[int, torch.Tensor], threads: int
             ) -> tuple[float, list[torch.Tensor]]:
    outputs = []
    started = time.perf_counter()
    for packed, scales, mins, k, n in layers:
        x, y = xs[k], torch.empty(xs[k].shape[0], n)
        lib.sm_int4_linear(x.data_ptr(), x.shape[0], k, packed.data_ptr(), scales.data_ptr(), mins.data_ptr(), None,
                           n, y.data_ptr(), threads)
        outputs.append(y)
    return time.perf_counter() - started, outputs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-rev", default="", help="git revision whose int4_kernel.c to compare against")
    p.add_argument("--isa", default="", choices=["", *ISAS], help="code path (default: the best this CPU runs)")
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--passes", type=int, default=10, help="passes per kernel and shape (the first 2 not counted)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"this checkout": SOURCE}
        if args.baseline_rev:
            old = Path(tmp) / "int4_kernel_baseline.c"
            old.write_text(subprocess.run(["git", "show", f"{args.baseline_rev}:specmesh/engine/int4_kernel.c"],
                                          cwd=ROOT, check=True, capture_output=True, text=True).stdout)
            sources = {args.baseline_rev: old, **sources}
        libs = {name: build(src, Path(tmp) / f"k{i}.so", args.isa) for i, (name, src) in enumerate(sources.items())}
        layers = mlp_layers()
        num_bytes = sum(t.numel() * t.element_size() for layer in layers for t in layer[:3])
        rows_out = []
        for m in (int(r) for r in split_csv(args.rows)):
            xs = {k: torch.randn(m, k) for k in (HIDDEN, INTERMEDIATE)}
            for threads in (int(t) for t in split_csv(args.threads)):
                seconds: dict[str, list[float]] = {name: [] for name in libs}
                for _ in range(args.passes):
                    outputs = {}
                    for name, lib in libs.items():
                        dt, outputs[name] = one_pass(lib, layers, xs, threads)
                        seconds[name].append(dt)
                    first, *rest = outputs.values()
                    assert all(torch.equal(a, b) for other in rest for a, b in zip(first, other, strict=True))
                row = {"rows": m, "threads": threads, "ms": {}, "gb_s": {}}
                for name, values in seconds.items():
                    median = statistics.median(values[2:])
                    row["ms"][name], row["gb_s"][name] = median * 1e3, num_bytes / median / 1e9
                rows_out.append(row)
                log(f"rows={m} threads={threads}: " + "  ".join(
                    f"{name} {row['ms'][name]:.1f} ms ({row['gb_s'][name]:.1f} GB/s)" for name in libs))
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"int4-prefetch-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"isa": args.isa or "best", "num_bytes": num_bytes, "rows": rows_out}, indent=1))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
