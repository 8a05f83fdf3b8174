"""bench.attention_kernel runs and prints its table (tiny shapes, no model)."""

from __future__ import annotations

import pytest
import torch

from bench import attention_kernel as bench_attention
from specmesh.engine import attention_kernel


def test_attention_kernel_bench_times_the_kernel_and_the_fallback(capsys) -> None:
    if not attention_kernel.supports(16, torch.float32):
        pytest.skip("no C compiler or AVX2")
    assert bench_attention.main(["--contexts", "20", "--streams", "1,3", "--layers", "2", "--heads", "4",
                                 "--kv-heads", "2", "--head-dim", "16", "--reps", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in table if line.strip().startswith("20")]
    assert [r[1] for r in rows] == ["1", "3"] and all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
