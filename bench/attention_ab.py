"""The attention kernel as it is here against an earlier revision's, on a step beside a long prompt: a chain of R
prompt rows late in an L-key prompt (one key list, tiles of rows) and one decode row over its own keys, 28 layers.

    python -m bench.attention_ab --baseline-rev HEAD~1                   # R = 1 and 6 over 3,500 keys, 2 threads
    python -m bench.attention_ab --baseline-rev a02e831~1 --rows 6 --keys 2000,3500 --threads 1,2
    python -m bench.attention_ab --baseline-rev HEAD --rows 1,4,12 --kv-dtypes float16,float32   # a half cache too

Builds `specmesh/engine/attention_kernel.c` from this checkout and from `git show REV:...` (each beside its
cpu_pool.h and, from the half cache on, attention_rows.h, through the engine's `cpu_build.library_path`), asserts
the two give bit-identical outputs, then times them alternating call by call (median and best of --reps calls over
every layer; the KV pools, ~200 MB at 3,500 keys, exceed the caches as a real step's do), over a float32 and/or a
float16 KV cache (--kv-dtypes; a revision from before the half cache takes float32 only).
Prints ms per step's attention and writes bench/results/attention-ab-*.json.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from bench.attention_kernel import pools
from bench.common import log, result_paths, run_metadata, split_csv, write_json
from specmesh.engine.cpu_build import library_path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "specmesh" / "engine"
LAYERS, HEADS, KV_HEADS, HEAD_DIM, DECODE_KEYS = 28, 12, 2, 128, 200
_P, _I = ctypes.c_void_p, ctypes.c_int64


KERNEL_FILES = ("attention_kernel.c", "cpu_pool.h", "attention_rows.h")   # the last one from the half cache on
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class Kernel(NamedTuple):
    lib: ctypes.CDLL
    takes_half: bool      # reads a half cache: sm_paged_attention takes a last argument, kv_half

    def attend(self, *args: object, kv_half: bool) -> None:
        self.lib.sm_paged_attention(*args, *([int(kv_half)] if self.takes_half else []))


def build(rev: str, out_dir: Path) -> Kernel:
    """attention_kernel.c with its headers at `rev` ('' = this checkout), built by the engine's own builder (its
    compiler and flags; cached by the source, headers and flags), loaded apart from the engine's shared pool; and
    whether it reads a half cache."""
    source = ENGINE / "attention_kernel.c"
    if rev:
        out_dir.mkdir(parents=True)
        for name in KERNEL_FILES:
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:specmesh/engine/{name}"],
                                   capture_output=True, text=True)
            if shown.returncode == 0:
                (out_dir / name).write_text(shown.stdout)
        source = out_dir / "attention_kernel.c"
    takes_half = (source.parent / "attention_rows.h").exists()
    lib = ctypes.CDLL(str(library_path(source)))
    lib.sm_paged_attention.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_float, _P, _P, ctypes.c_int,
                                       *([ctypes.c_int] if takes_half else [])]
    lib.sm_row_tile.restype = ctypes.c_int
    return Kernel(lib, takes_half)


def step(num_rows: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """query [R + 1, H, D]; key slots (the prompt's chain, then the decode row's own keys, scattered over the pool);
    row starts and lengths: prompt row r sees its first num_keys + r + 1 keys, the decode row DECODE_KEYS."""
    g = torch.Generator().manual_seed(num_rows)
    perm = torch.randperm(num_keys + num_rows + DECODE_KEYS, generator=g).to(torch.int32)
    starts = torch.tensor([0] * num_rows + [num_keys + num_rows])
    lengths = torch.tensor([num_keys + r + 1 for r in range(num_rows)] + [DECODE_KEYS])
    return torch.randn(num_rows + 1, HEADS, HEAD_DIM, generator=g), perm, starts, lengths


def measure(kernels: dict[str, Kernel], num_rows: int, num_keys: int, threads: int, reps: int,
            kv_dtype: torch.dtype = torch.float32) -> dict[str, dict]:
    layers = [(k.to(kv_dtype), v.to(kv_dtype)) for k, v in pools(LAYERS, num_keys + num_rows + DECODE_KEYS, KV_HEADS,
                                                                   HEAD_DIM)]
    query, slots, starts, lengths = step(num_rows, num_keys)
    row_tile = max(k.lib.sm_row_tile() for k in kernels.values())      # each kernel's scratch: a tile's probs a thread
    scratch = torch.empty(threads * row_tile * HEADS * (int(lengths.max()) + 1))

    def run(kernel: Kernel) -> list[torch.Tensor]:
        outs = []
        for keys, values in layers:
            out = torch.empty_like(query)
            kernel.attend(query.data_ptr(), keys.data_ptr(), values.data_ptr(), slots.data_ptr(), starts.data_ptr(),
                          lengths.data_ptr(), len(query), HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5,
                          scratch.data_ptr(), out.data_ptr(), threads, kv_half=kv_dtype == torch.float16)
            outs.append(out)
        return outs

    first, *others = [run(kernel) for kernel in kernels.values()]
    for outs in others:
        assert all(torch.equal(a, b) for a, b in zip(first, outs, strict=True)), "the kernels' bits differ"
    seconds: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(reps):
        for name, kernel in kernels.items():
            started = time.perf_counter()
            run(kernel)
            seconds[name].append(time.perf_counter() - started)
    return {name: {"median_ms": statistics.median(ts) * 1e3, "best_ms": min(ts) * 1e3} for name, ts in seconds.items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-rev", required=True, help="git revision whose attention kernel to compare against")
    p.add_argument("--rows", default="1,6", help="prompt rows beside the decode row")
    p.add_argument("--keys", default="3500", help="the prompt's keys before its rows")
    p.add_argument("--threads", default="2")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--kv-dtypes", default="float32", help="KV cache element types timed: float32, float16")
    p.add_argument("--name", default="attention-ab")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {args.baseline_rev: build(args.baseline_rev, Path(tmp) / "baseline"),
                   "this checkout": build("", Path(tmp) / "here")}
        kv_dtypes = split_csv(args.kv_dtypes)
        if "float16" in kv_dtypes and not all(k.takes_half for k in kernels.values()):
            p.error(f"{args.baseline_rev}'s kernel reads no half cache: --kv-dtypes float32")
        for kv_name in kv_dtypes:
            for num_keys in (int(k) for k in split_csv(args.keys)):
                for num_rows in (int(r) for r in split_csv(args.rows)):
                    for threads in (int(t) for t in split_csv(args.threads)):
                        times = measure(kernels, num_rows, num_keys, threads, args.reps, KV_DTYPES[kv_name])
                        rows.append({"kv_dtype": kv_name, "keys": num_keys, "rows": num_rows, "threads": threads,
                                     "ms": times})
                        log(f"{kv_name} cache, {num_rows} row(s) over {num_keys} keys + a decode row, {threads} "
                            "thread(s): " + "  ".join(f"{name} {t['median_ms']:.1f} ms (best {t['best_ms']:.1f})"
                                                      for name, t in times.items()) + "; bits identical")
    json_path, _ = result_paths(args.name)
    write_json(json_path, {"meta": run_metadata(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
