"""Batch-invariant int8 linear layers: int8 weights (one scale per output channel), activations quantized with
one scale per token, integer accumulation.

Why: dynamic int8 (`quantize_dynamic`) computes ONE activation scale over every token in the forward, so a token's
logits depend on which other tokens share the forward, and greedy speculation stops matching plain decoding. Here
each row (token) is scaled by its own absmax before quantization, the matmul accumulates in integers (exact), and
the output is rescaled per row: a token's result is the same whatever else is in the batch, bit for bit. It costs
about what dynamic int8 costs on AVX2 CPUs (measured in bench/verify_numerics.py), ~3x faster than fp32 for a
1-token decode and far cheaper for multi-token verification.

Activations use 7 bits ([-63, 63] around the zero point 64 of a quint8) so fbgemm's u8 x s8 accumulation cannot
saturate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ACT_LEVELS = 63.0
ACT_ZERO_POINT = 64


class Int8PerTokenLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        w_scale = (weight.abs().amax(1) / 127).clamp_min(1e-12).double()          # [out]
        qweight = torch.quantize_per_channel(weight, w_scale, torch.zeros(weight.shape[0], dtype=torch.long), 0,
                                             torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float().contiguous()                        # [tokens, in]
        absmax = rows.abs().amax(-1, keepdim=True).clamp_min(1e-30)                 # one scale per token
        y: torch.Tensor = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            rows * (ACT_LEVELS / absmax), 1.0, ACT_ZERO_POINT, self.packed) * (absmax / ACT_LEVELS)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replaces every nn.Linear in the model (lm_head included) in place by make(linear); returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))
                count += 1
    return count


def quantize_linears(model: nn.Module) -> int:
    """Every nn.Linear (lm_head included) becomes an Int8PerTokenLinear; returns how many were replaced."""
    return replace_linears(model, Int8PerTokenLinear)


class Int8RowwiseIntMM(nn.Module):
    """A candidate kernel (bench/verifier_overhead.py --kernels): symmetric int8 activations with one scale per row,
    int8 weights with one scale per output channel, `torch._int_mm` (exact int32 accumulation), then rescaling."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.w_scale = (weight.abs().amax(1) / 127).clamp_min(1e-12)                      # [out]
        self.w_int8_t = torch.round(weight / self.w_scale[:, None]).to(torch.int8).t().contiguous()  # [in, out]
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        scale = rows.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127                  # [tokens, 1]
        acc = torch._int_mm(torch.round(rows / scale).to(torch.int8), self.w_int8_t)       # [tokens, out] int32
        y = acc.float() * scale * self.w_scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)
