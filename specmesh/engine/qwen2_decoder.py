"""specmesh's own forward of a Qwen2 decoder over the paged KV cache (nano-vllm style), used instead of transformers'.

transformers' forward spends, on a CPU decode step of a small model, about as long in Python and small torch ops as
in the matmuls (Qwen2.5-0.5B int4: ~10 of ~28 ms): per layer three q/k/v projections, rotate_half and its cats, a mask
builder, kwargs plumbing through four module levels. Here, per layer and for the whole ragged batch:

    x = rms_norm(h);  qkv = W_qkv x                                   (one fused q|k|v linear)
    rope_store: q <- rope(q); the pool's slots of the new tokens <- rope(k), v     (one C pass)
    h = h + W_o attend(q)                                             (paged_attention.attend)
    x = rms_norm(h);  g|u = W_gu x;  h = h + W_down (silu(g) * u)     (one fused gate|up linear)

where each residual add and the norm after it are one C call and rope_store another (decoder_kernel.c),
and cos/sin come from a table built once from the model's own rotary module. Every op works row by row, so a token's
numbers stay independent of what shares the forward (the int8 / int4 linears are per token too): the exactness
tests of the quantized verifier run through this forward.

Projections are fused before quantization (`fuse_projections`): the int8 / int4 linears quantize each token's input
once with one scale, and every output channel is its own integer dot product, so a fused linear gives bit for bit
the outputs of the separate ones (tested). Unfused models (quantized before the fusion) run too.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2Config

from specmesh.engine.cpu_build import load_optional
from specmesh.engine.errors import ForwardInterrupted
from specmesh.engine.paged_attention import PagedBatch, attend

SOURCE = Path(__file__).with_name("decoder_kernel.c")
_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Norm(Protocol):
    weight: torch.Tensor


class _Attention(Protocol):
    q_proj: nn.Module              # q/k/v_proj before fusion, qkv_proj after (fuse_projections)
    k_proj: nn.Module
    v_proj: nn.Module
    qkv_proj: nn.Module
    o_proj: nn.Module


class _Mlp(Protocol):
    gate_proj: nn.Module           # gate/up_proj before fusion, gate_up_proj after
    up_proj: nn.Module
    gate_up_proj: nn.Module
    down_proj: nn.Module


class _Layer(Protocol):
    self_attn: _Attention
    mlp: _Mlp
    input_layernorm: _Norm
    post_attention_layernorm: _Norm


class _Qwen2Model(Protocol):
    """What this forward reads of transformers' Qwen2Model (`model.model`; nn.Module attributes are untyped)."""

    embed_tokens: nn.Module
    layers: Sequence[_Layer]
    norm: _Norm
    rotary_emb: nn.Module


def _inner(model: nn.Module) -> _Qwen2Model:
    return cast(_Qwen2Model, model.model)


def _config(model: nn.Module) -> Qwen2Config:
    """The model's config, typed as a Qwen2Config (what it is when its model_type is "qwen2": `supports` checks)."""
    return cast(Qwen2Config, model.config)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_optional(SOURCE, "using transformers' forward")
    if lib is None:
        return None
    lib.sm_add_rms_norm.argtypes = [_P, _P, _P, _I, _I, ctypes.c_float, _P]
    lib.sm_add_rms_norm.restype = None
    lib.sm_rope_store.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, ctypes.c_int]
    lib.sm_rope_store.restype = None
    return lib


def supports(model: nn.Module) -> bool:
    """A float32 Qwen2 decoder with plain RoPE and SiLU, no sliding window, and the kernel built."""
    cfg = _config(model)
    if cfg.model_type != "qwen2":       # (then the config is a Qwen2Config)
        return False
    rope = cfg.rope_parameters or {}
    return (cfg.hidden_act == "silu" and rope.get("rope_type", "default") == "default" and not cfg.use_sliding_window
            and next(model.parameters()).dtype == torch.float32 and _library() is not None)


def _fuse(linears: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the given linears' outputs side by side."""
    has_bias = linears[0].bias is not None
    fused = nn.Linear(linears[0].in_features, sum(x.out_features for x in linears), bias=has_bias)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([x.weight for x in linears]))
        if has_bias:
            fused.bias.copy_(torch.cat([x.bias for x in linears]))
    return fused.requires_grad_(False)


def fuse_projections(model: nn.Module) -> bool:
    """Replaces each layer's q/k/v_proj by `qkv_proj` and gate/up_proj by `gate_up_proj` (plain nn.Linear only, so
    before quantization); returns whether the model now has them. transformers' forward cannot run it afterwards."""
    if not supports(model):
        return False
    for layer in _inner(model).layers:
        attn, mlp = layer.self_attn, layer.mlp
        # getattr: fused (or quantized) layers have no plain q/k/v_proj linears
        q, k, v = (getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj"))
        if not (isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and isinstance(v, nn.Linear)):
            return False
        attn.qkv_proj = _fuse([q, k, v])
        mlp.gate_up_proj = _fuse([cast(nn.Linear, mlp.gate_proj), cast(nn.Linear, mlp.up_proj)])   # plain too
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
    return True


def is_fused(model: nn.Module) -> bool:
    # getattr: any model is asked, not only a decoder with model.model.layers
    layers: Sequence[_Layer] | None = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    return hasattr(layers[0].self_attn, "qkv_proj")


class RopeTable:
    """cos and sin [positions, D/2] from the model's rotary module (its first half: the module repeats it), grown on
    demand."""

    def __init__(self, rotary: nn.Module, head_dim: int) -> None:
        self.rotary = rotary
        self.half = head_dim // 2
        self.cos = self.sin = torch.empty(0, self.half)

    def rows(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        if max_position >= len(self.cos):
            size = max(2 * len(self.cos), max_position + 1, 256)
            probe = torch.empty(1, dtype=torch.float32)
            cos, sin = self.rotary(probe, torch.arange(size).unsqueeze(0))          # [1, size, D]
            self.cos = cos[0, :, :self.half].float().contiguous()
            self.sin = sin[0, :, :self.half].float().contiguous()
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


class Qwen2Decoder:
    """Runs `model.model` (a Qwen2Model whose attention reads the paged cache) over a flattened ragged batch."""

    def __init__(self, model: nn.Module) -> None:
        cfg = _config(model)
        self.inner = _inner(model)
        lib = _library()
        if lib is None:
            raise RuntimeError("the decoder kernel is not built: check supports() first")
        self.lib = lib
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads: int = cfg.num_key_value_heads or self.num_heads
        # getattr: head_dim is a key of some Qwen2 checkpoints' configs only (Qwen2Config does not declare it)
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.eps = cfg.rms_norm_eps
        self.rope = RopeTable(self.inner.rotary_emb, self.head_dim)
        self.fused = is_fused(model)            # fused projections (built by build.py), else the model's own three

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, max_position: int, batch: PagedBatch,
                keep: torch.Tensor, interrupt: Callable[[], bool] | None = None) -> torch.Tensor:
        """input_ids, position_ids [T]; keep: the rows whose hidden states are wanted. Returns the final-normed
        hidden states of those rows [len(keep), hidden]. interrupt: asked before each layer; True raises
        ForwardInterrupted (the KV already written for these positions is rewritten by whatever runs them next)."""
        cos, sin = self.rope.rows(position_ids, max_position)                      # [T, D/2] each
        hidden = self.inner.embed_tokens(input_ids).contiguous()                   # [T, hidden], the residual stream
        layers = self.inner.layers
        x = self._add_norm(hidden, None, layers[0].input_layernorm)
        for index, layer in enumerate(layers):
            if interrupt is not None and interrupt():
                raise ForwardInterrupted(f"interrupted before layer {index}")
            attended = self._attention(index, layer, x, cos, sin, batch)
            x = self._add_norm(hidden, attended, layer.post_attention_layernorm)
            after = layers[index + 1].input_layernorm if index + 1 < len(layers) else self.inner.norm
            x = self._add_norm(hidden, self._mlp(layer.mlp, x), after)
        return x.index_select(0, keep)

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, norm: _Norm) -> torch.Tensor:
        """hidden += delta (in place), then RMSNorm(hidden) * norm.weight as a new tensor."""
        out = torch.empty_like(hidden)
        if delta is not None:
            delta = delta.contiguous()
        self.lib.sm_add_rms_norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(),
                                 norm.weight.data_ptr(), hidden.shape[0], hidden.shape[1], self.eps, out.data_ptr())
        return out

    def _attention(self, index: int, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   batch: PagedBatch) -> torch.Tensor:
        attn = layer.self_attn
        qkv = attn.qkv_proj(x) if self.fused else torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
        qkv = qkv.contiguous()                                                      # [T, (H + 2 kvH) D]
        rows = qkv.shape[0]
        query = torch.empty(rows, self.num_heads, self.head_dim)
        k_cache, v_cache = batch.cache.key_caches[index], batch.cache.value_caches[index]
        self.lib.sm_rope_store(qkv.data_ptr(), rows, self.num_heads, self.num_kv_heads, self.head_dim,
                               cos.data_ptr(), sin.data_ptr(), batch.slot_mapping.data_ptr(), k_cache.data_ptr(),
                               v_cache.data_ptr(), query.data_ptr(), int(k_cache.dtype == torch.float16))
        out = attend(batch, index, query, self.scaling)                             # [T, H, D]
        projected: torch.Tensor = attn.o_proj(out.reshape(rows, self.num_heads * self.head_dim))
        return projected

    def _mlp(self, mlp: _Mlp, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        down: torch.Tensor = mlp.down_proj(F.silu(gate) * up)
        return down
