"""Batch-invariant int4 linear layers: 4-bit weights in groups of 32 inputs (an fp16 scale and minimum per group, 5
bits per weight), activations quantized to int8 with one scale per token, integer dot products per group.

Why: decoding on a CPU streams every weight once per token, so its speed is set by the bytes per weight. int8 reads
8 bits; this reads 5, like llama.cpp's Q4 formats (the offline models are Q4_K_M GGUF files to begin with: their
weights are 16-level affine per 32-weight sub-block, which this grid holds closely). Like `int8_linear`, a token's
result is bit-identical whatever else shares the forward, so greedy speculation stays exact (the kernel's contract
is in `int4_kernel.c`).

    w[o, 32g + j] ~= scale[o, g] * q[o, g, j] + min[o, g],   q in 0..15,
    scale = (max - min) / 15 and min over the group, both rounded to fp16 before q is chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from specmesh.engine import int4_kernel
from specmesh.engine.huge_pages import huge_page_copies
from specmesh.engine.int4_kernel import GROUP, LANES
from specmesh.engine.int8_linear import replace_linears
from specmesh.engine.kernel_threads import num_kernel_threads

WEIGHT_NAMES = ("packed", "scales", "mins", "bias")     # what a forward streams, per linear
PARALLEL_MIN_OUT = 256          # fewer output rows than this: one thread (the hand-off costs more)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [n, k] (n a multiple of 8, k of 32) -> the kernel's layout (see int4_kernel.c): packed q
    [n/8, k/32, 4, 32] uint8, scale and min [n/8, k/32, 8] fp16."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    mins = groups.amin(-1).half()
    scales = ((groups.amax(-1) - mins.float()) / 15).half()
    step = scales.float().unsqueeze(-1)
    q = torch.where(step > 0, (groups - mins.float().unsqueeze(-1)) / step.clamp_min(1e-30), 0.0)
    q = q.round().clamp(0, 15).to(torch.uint8)                                   # [n, G, 32]
    # [tile, lane, G, block s, half h, i] -> [tile, G, s, h, 4 * lane + i]: byte 4 * lane + i of block s holds input
    # 8s + i (h = 0) in its low nibble and 8s + 4 + i (h = 1) in its high nibble.
    tiles, num_groups = n // LANES, k // GROUP
    halves = q.reshape(tiles, LANES, num_groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5).reshape(tiles, num_groups, 4, 2, 32)
    packed = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)

    def lanes(t: torch.Tensor) -> torch.Tensor:                                   # [n, G] -> [n/8, G, 8]
        return t.reshape(tiles, LANES, num_groups).transpose(1, 2).contiguous()
    return packed.contiguous(), lanes(scales), lanes(mins)


def dequantize_weight(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float weights the kernel multiplies by ([n, k] float32): for tests and error measurements."""
    tiles, num_groups = packed.shape[:2]
    halves = torch.stack([packed & 0x0F, packed >> 4], dim=3)                  # [tile, G, s, h, 32]
    q = halves.reshape(tiles, num_groups, 4, 2, LANES, 4).permute(0, 4, 1, 2, 3, 5).reshape(
        tiles * LANES, num_groups, GROUP).float()                               # [n, G, 32]

    def rows(t: torch.Tensor) -> torch.Tensor:                                  # [n/8, G, 8] -> [n, G, 1]
        return t.transpose(1, 2).reshape(tiles * LANES, num_groups, 1).float()
    return (q * rows(scales) + rows(mins)).reshape(tiles * LANES, -1)


class Int4GroupLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.lib = int4_kernel.library()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # zero weights (and inputs) pad k to whole groups; zero rows pad n to whole tiles (sliced off)
        self.padded_in = -(-self.in_features // GROUP) * GROUP
        self.padded_out = -(-self.out_features // LANES) * LANES
        weight = nn.functional.pad(weight, (0, self.padded_in - self.in_features, 0, self.padded_out -
                                            self.out_features))
        self.packed, self.scales, self.mins = quantize_weight(weight)
        self.bias = None if linear.bias is None else nn.functional.pad(
            linear.bias.detach().float(), (0, self.padded_out - self.out_features)).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        if self.padded_in != self.in_features:
            rows = nn.functional.pad(rows, (0, self.padded_in - self.in_features))
        rows = rows.contiguous()
        m = rows.shape[0]
        n = self.padded_out
        y = torch.empty(m, n, dtype=torch.float32)
        threads = num_kernel_threads() if n >= PARALLEL_MIN_OUT else 1
        # quantizes each row into the kernel's own scratch, then the integer matmul over every output tile
        bias = None if self.bias is None else self.bias.data_ptr()
        self.lib.sm_int4_linear(rows.data_ptr(), m, self.padded_in, self.packed.data_ptr(), self.scales.data_ptr(),
                                self.mins.data_ptr(), bias, n, y.data_ptr(), threads)
        if self.padded_out != self.out_features:
            y = y[:, :self.out_features]
        return y.reshape(*shape[:-1], self.out_features)


def quantize_linears_int4(model: nn.Module) -> int:
    """Every nn.Linear (lm_head included) becomes an Int4GroupLinear; returns how many were replaced."""
    return replace_linears(model, Int4GroupLinear)


def replace_int4_weights(model: nn.Module, copy: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]) -> int:
    """Every Int4GroupLinear's weights, in the model's module order, replaced by `copy` of them (one call for all);
    returns the bytes replaced."""
    owners = [(module, name) for module in model.modules() if isinstance(module, Int4GroupLinear)
              for name in WEIGHT_NAMES if getattr(module, name) is not None]
    copies = copy([getattr(module, name) for module, name in owners])
    for (module, name), tensor in zip(owners, copies, strict=True):
        setattr(module, name, tensor)
    return sum(tensor.numel() * tensor.element_size() for tensor in copies)


def int4_weights_to_huge_pages(model: nn.Module) -> int:
    """Moves every Int4GroupLinear's weights, in the model's module order, into one mapping advised for huge pages
    (huge_pages.py: fewer TLB misses as a decode step streams them; the same bytes). Returns the bytes moved."""
    return replace_int4_weights(model, huge_page_copies)
