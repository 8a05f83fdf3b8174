"""Decode-sized int4 calls on the path measured fastest at load (specmesh/engine/int4_small_calls.py): the choice,
and that it never changes a bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specmesh.engine import int4_kernel
from specmesh.engine.int4_linear import Int4GroupLinear
from specmesh.engine.int4_small_calls import calibrate_small_calls, small_call_rows

BEST_ISA = int4_kernel.instruction_set()


def test_small_calls_take_the_avx2_path_up_to_the_last_size_where_it_was_faster_at_every_size() -> None:
    def seconds(avx2: tuple[float, float, float], vnni: tuple[float, float, float]) -> dict[tuple[str, int], float]:
        return {**{("avx2", m): s for m, s in zip((1, 2, 4), avx2, strict=True)},
                **{("avx512vnni", m): s for m, s in zip((1, 2, 4), vnni, strict=True)}}
    assert small_call_rows(seconds((4.8, 4.5, 4.9), (5.7, 5.8, 6.8)), "avx512vnni") == 4   # a 2-core Zen 4
    assert small_call_rows(seconds((4.8, 5.8, 4.9), (5.7, 5.8, 6.8)), "avx512vnni") == 1   # not at 2: stops there
    assert small_call_rows(seconds((5.5, 4.5, 4.9), (5.7, 5.8, 6.8)), "avx512vnni") == 0   # within MIN_GAIN at 1
    assert small_call_rows(seconds((6.0, 6.0, 9.0), (5.7, 5.8, 6.8)), "avx512vnni") == 0


@pytest.mark.skipif(BEST_ISA == "avx2", reason="this CPU has only the AVX2 path")
def test_calls_on_the_small_path_give_the_bits_of_the_chosen_one() -> None:
    torch.manual_seed(0)
    linear = Int4GroupLinear(nn.Linear(512, 264))             # 33 output tiles: a lone last tile on the VNNI path
    x = torch.randn(8, 512)
    try:
        plain = [linear(x[:m]) for m in range(1, 9)]
        assert int4_kernel.set_small_calls("avx2", 4) == "avx2"
        small = [linear(x[:m]) for m in range(1, 9)]
    finally:
        int4_kernel.set_small_calls(None, 0)
    assert all(torch.equal(a, b) for a, b in zip(plain, small, strict=True))


def test_a_path_above_the_chosen_one_is_refused() -> None:
    try:
        int4_kernel.instruction_set("avx2")
        assert int4_kernel.set_small_calls("avx512vnni", 4) is None
    finally:
        int4_kernel.instruction_set(BEST_ISA)


def test_calibration_says_what_it_chose_and_keeps_the_outputs() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(Int4GroupLinear(nn.Linear(256, 512)), Int4GroupLinear(nn.Linear(512, 1024)))
    x = torch.randn(3, 256)
    before = model(x)
    try:
        line = calibrate_small_calls(model, 1)
        assert line.startswith("int4 calls of ")
        assert torch.equal(model(x), before)
    finally:
        int4_kernel.set_small_calls(None, 0)
