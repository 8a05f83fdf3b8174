"""The int4 kernel (specmesh/engine/int4_kernel.c): exact against a float64 reference of the same quantized numbers,
bit-identical whatever shares the forward or how many threads run it, and its quantization grid."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from specmesh.engine import int4_kernel
from specmesh.engine.int4_linear import Int4GroupLinear, dequantize_weight, quantize_weight
from specmesh.engine.kernel_threads import kernel_threads

SHAPES = [(64, 64), (8960 // 8, 1536), (70, 40), (256, 96)]     # (out, in); odd ones are padded


BEST_ISA = int4_kernel.instruction_set()
ISAS = [isa for isa in int4_kernel.ISAS if int4_kernel.instruction_set(isa) == isa]
int4_kernel.instruction_set(BEST_ISA)


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each code path this CPU can run, pinned for one test (then the best one again)."""
    yield int4_kernel.instruction_set(request.param)
    int4_kernel.instruction_set(BEST_ISA)


def linear(out_features: int, in_features: int, seed: int = 0, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def reference(layer: Int4GroupLinear, lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """float64: per-row int8 activations (absmax / 127, round half to even) times the dequantized int4 weights."""
    absmax = x.abs().amax(-1, keepdim=True)
    xq = torch.round(x * (127.0 / absmax)).clamp(-127, 127)
    w = dequantize_weight(layer.packed, layer.scales, layer.mins)[:lin.out_features, :lin.in_features].double()
    y = (xq.double() @ w.t()) * (absmax.double() / 127.0)
    return y + lin.bias.double() if lin.bias is not None else y


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_kernel_matches_the_float64_reference(out_features: int, in_features: int, isa: str) -> None:
    lin = linear(out_features, in_features)
    layer = Int4GroupLinear(lin)
    x = torch.randn(9, in_features)
    y = layer(x)
    assert y.shape == (9, out_features)
    torch.testing.assert_close(y.double(), reference(layer, lin, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_a_row_is_bit_identical_alone_in_any_batch_and_at_any_thread_count(out_features: int, in_features: int,
                                                                           isa: str) -> None:
    layer = Int4GroupLinear(linear(out_features, in_features, seed=1))
    x = torch.randn(37, in_features) * torch.linspace(0.1, 30.0, 37)[:, None]   # very different row scales
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = layer(x)
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 33):     # every row tile size (both paths) and a partial row block
            assert torch.equal(layer(x[:m]), together[:m]), m
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        assert torch.equal(alone, together)
        torch.set_num_threads(2)
        assert torch.equal(layer(x), together)        # output tiles split across two threads
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(len(ISAS) < 2, reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("m", [1, 2, 7, 16, 37, 200])
def test_every_code_path_gives_bit_identical_outputs(m: int) -> None:
    """A verifier on an AMX or VNNI CPU decodes exactly what one on an AVX2-only CPU decodes (AMX: whole 16-row
    blocks, a zero-padded last block, more rows than one cached row block)."""
    layer = Int4GroupLinear(linear(8960 // 8, 1536, seed=3))
    x = torch.randn(m, 1536) * torch.linspace(0.1, 30.0, m)[:, None]
    outputs = []
    try:
        for name in ISAS:
            int4_kernel.instruction_set(name)
            outputs.append(layer(x))
    finally:
        int4_kernel.instruction_set(BEST_ISA)
    for name, output in zip(ISAS[1:], outputs[1:], strict=True):
        assert torch.equal(output, outputs[0]), name


@pytest.mark.parametrize("out_features", [8, 24, 8 * 37])
def test_an_odd_number_of_output_tiles_gives_the_bits_of_every_path(out_features: int) -> None:
    """The VNNI path takes output tiles in pairs: a lone last tile (of the layer or of a thread's range) runs masked,
    on one and two threads, with and without bias, and gives AVX2's bits."""
    threads = torch.get_num_threads()
    try:
        for num_threads, bias in [(1, True), (2, True), (2, False)]:
            torch.set_num_threads(num_threads)
            layer = Int4GroupLinear(linear(out_features, 96, seed=out_features, bias=bias))
            x = torch.randn(11, 96)
            outputs = []
            for name in ISAS:
                int4_kernel.instruction_set(name)
                outputs.append(torch.cat([layer(x), layer(x[:1]), layer(x[3:5])]))
            for name, output in zip(ISAS[1:], outputs[1:], strict=True):
                assert torch.equal(output, outputs[0]), (name, num_threads, bias)
    finally:
        int4_kernel.instruction_set(BEST_ISA)
        torch.set_num_threads(threads)


@pytest.mark.skipif("amx" not in ISAS, reason="this CPU has no AMX")
def test_amx_rows_are_bit_identical_to_one_row_decoding_in_every_layer_shape() -> None:
    """Prefill-sized calls (AMX) give each row exactly what a one-row decode (VNNI) gives it, on two threads whose
    output ranges end in a lone 8-channel tile."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for out_features, in_features in [(1536, 8960), (256, 1536), (24, 64)]:
            layer = Int4GroupLinear(linear(out_features, in_features, seed=4))
            x = torch.randn(19, in_features)
            together = layer(x)
            alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
            assert torch.equal(together, alone), (out_features, in_features)
    finally:
        torch.set_num_threads(threads)


def test_weights_on_the_grid_round_trip_exactly() -> None:
    """A group of 16-level affine weights (what Q4_K GGUF sub-blocks hold) is stored without loss."""
    torch.manual_seed(2)
    n, k = 16, 128
    q = torch.randint(0, 16, (n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15                      # each group uses its whole range
    scales = (torch.rand(n, k // 32, 1) * 0.01 + 0.001).half().float()
    mins = (-torch.rand(n, k // 32, 1) * 0.05).half().float()
    weight = (q * scales + mins).reshape(n, k)
    restored = dequantize_weight(*quantize_weight(weight))
    torch.testing.assert_close(restored, weight, rtol=0, atol=2e-6)


def test_quantization_error_is_within_half_a_step() -> None:
    weight = torch.randn(32, 256)
    packed, scales, mins = quantize_weight(weight)
    restored = dequantize_weight(packed, scales, mins)
    step = scales.transpose(1, 2).reshape(32, 8, 1).float().expand(32, 8, 32).reshape(32, 256)
    assert ((restored - weight).abs() <= step / 2 + 2e-3 * step + 1e-6).all()


def test_no_bias_and_zero_rows() -> None:
    lin = linear(64, 64, bias=False)
    layer = Int4GroupLinear(lin)
    x = torch.randn(3, 64)
    x[1] = 0.0
    y = layer(x)
    assert torch.equal(y[1], torch.zeros(64))
    torch.testing.assert_close(y[[0, 2]].double(), reference(layer, lin, x[[0, 2]]), rtol=1e-5, atol=1e-5)


def test_the_thread_pool_gives_the_same_outputs_under_oversubscription_and_concurrent_callers() -> None:
    """More kernel threads than cores, so workers lose their core mid-job and wake late (after their job is done,
    or the next one posted), and several callers at once: every output equals the one-thread output."""
    layers = [Int4GroupLinear(linear(out, 96, seed=out)) for out in (256, 264, 1120)]   # 32, 33, 140 tiles
    xs = [torch.randn(m, 96) for m in (1, 3, 9)]
    with kernel_threads(1):
        expected = [[layer(x) for x in xs] for layer in layers]
    mismatches: list[tuple[int, int, int]] = []

    def run(num_threads: int) -> None:
        with kernel_threads(num_threads):
            for _ in range(60):
                for i, layer in enumerate(layers):
                    for j, x in enumerate(xs):
                        if not torch.equal(layer(x), expected[i][j]):
                            mismatches.append((num_threads, i, j))
    run(5)
    callers = [threading.Thread(target=run, args=(n,)) for n in (5, 3, 2)]   # one drives the pool, others run alone
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert mismatches == []


def test_rows_are_quantized_by_the_round_half_even_rule() -> None:
    """The kernel's activation quantizer (vectorized): x * float32(127 / absmax) rounded half to even and clamped,
    group sums exact, whatever the row's scale; exact halves included."""
    lib = int4_kernel.library()
    lib.sm_quantize_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p]
    torch.manual_seed(5)
    halves = torch.cat([torch.arange(-126.5, 127.0, 1.0)[:223], torch.tensor([127.0])]).reshape(1, -1)  # scale 1: ties
    for x in (torch.randn(9, 1536) * torch.logspace(-4, 3, 9)[:, None], torch.zeros(2, 64),
              torch.cat([halves, -halves]), torch.randn(3, 8960)):
        m, k = x.shape
        xq, row_scale, xsum = torch.empty(m, k, dtype=torch.int8), torch.empty(m), torch.empty(m, k // 32)
        lib.sm_quantize_rows(x.data_ptr(), m, k, xq.data_ptr(), row_scale.data_ptr(), xsum.data_ptr())
        absmax = x.abs().amax(-1, keepdim=True)
        inv = torch.where(absmax > 0, torch.tensor(127.0) / absmax, torch.tensor(0.0))
        expected = torch.round(x * inv).clamp(-127, 127).to(torch.int8)
        assert torch.equal(xq, expected)
        assert torch.equal(row_scale, torch.where(absmax > 0, absmax / 127.0, torch.tensor(1.0)).squeeze(-1))
        assert torch.equal(xsum, expected.float().reshape(m, k // 32, 32).sum(-1))
