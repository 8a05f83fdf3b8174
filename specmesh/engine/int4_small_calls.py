"""Which int4 code path runs decode-sized calls on this CPU, measured once when a model is loaded.

A decode step's matmuls have a row or a few: they are bound by how fast the weights stream in from memory, and which
path streams fastest depends on the CPU. On a 2-core Zen 4 (AVX-512 executed as two 256-bit halves) the AVX2 path,
one 8-channel tile and one weight stream at a time, beat the AVX-512 VNNI path's tile pairs up to 4 rows (the 1.5B
target's whole forward on 2 threads, `python -m bench.quantized_forward --int4-isas avx2,avx512vnni`: 1 row 34.8
against 38.6 ms, 2 rows 35.0 / 41.3, 4 rows 43.7 / 46.8, 8 rows 75.8 / 55.9), while on a Zen 5 both took the same
at 1 row. So at load the model's largest int4 linear (the LM head: ~146 MB for the 1.5B target, beyond any L3) runs
1, 2 and 4 rows on both paths, alternating, and calls of up to the largest row count where the AVX2 path was faster
by MIN_GAIN at that count and every smaller one run on it (int4_kernel.c's `sm_set_small_calls`). Every path gives
the same bits (tests/test_int4_linear.py), so the choice changes only the time. Pinning a path
(`int4_kernel.instruction_set(wanted)`) clears it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping

import torch
from torch import nn

from specmesh.engine import int4_kernel
from specmesh.engine.int4_linear import Int4GroupLinear
from specmesh.engine.kernel_threads import kernel_threads

CANDIDATE_ROWS = (1, 2, 4)      # call sizes tried, smallest first
REPS = 5                        # calls per path and size (the median counts)
MIN_GAIN = 0.05                 # the AVX2 path must be this much faster to take a call size
SMALL_PATH = "avx2"


def small_call_rows(seconds: Mapping[tuple[str, int], float], chosen: str) -> int:
    """The most rows a call may have to run on SMALL_PATH: the largest candidate size where it beat `chosen` by
    MIN_GAIN, as it did at every smaller size; 0 = none."""
    rows = 0
    for m in CANDIDATE_ROWS:
        if seconds[(SMALL_PATH, m)] * (1 + MIN_GAIN) > seconds[(chosen, m)]:
            break
        rows = m
    return rows


def calibrate_small_calls(model: nn.Module, num_threads: int) -> str:
    """Measures, sets and describes (one line) the path of this process's decode-sized int4 calls."""
    chosen = int4_kernel.instruction_set()
    linears = [m for m in model.modules() if isinstance(m, Int4GroupLinear)]
    if chosen == SMALL_PATH or not linears:
        return f"int4 calls of every size run on the {chosen} path"
    linear = max(linears, key=lambda m: m.packed.numel())
    seconds: dict[tuple[str, int], float] = {}
    try:
        with kernel_threads(num_threads):
            for m in CANDIDATE_ROWS:
                x = torch.randn(m, linear.in_features)
                times: dict[str, list[float]] = {SMALL_PATH: [], chosen: []}
                for _ in range(REPS):
                    for isa, measured in times.items():
                        int4_kernel.set_small_calls(isa, m)
                        started = time.perf_counter()
                        linear(x)
                        measured.append(time.perf_counter() - started)
                seconds.update({(isa, m): statistics.median(ts) for isa, ts in times.items()})
    finally:
        int4_kernel.set_small_calls(None, 0)
    rows = small_call_rows(seconds, chosen)
    timings = ", ".join(f"{m} row(s) {seconds[(SMALL_PATH, m)] * 1e3:.1f} / {seconds[(chosen, m)] * 1e3:.1f} ms"
                        for m in CANDIDATE_ROWS)
    if rows:
        int4_kernel.set_small_calls(SMALL_PATH, rows)
        return (f"int4 calls of up to {rows} row(s) run on the {SMALL_PATH} path, the rest on {chosen} ({SMALL_PATH} / "
                f"{chosen}, {num_threads} thread(s), the largest linear: {timings})")
    return f"int4 calls of every size run on the {chosen} path ({SMALL_PATH} / {chosen}: {timings})"
