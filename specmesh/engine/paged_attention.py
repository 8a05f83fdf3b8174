"""Paged KV storage and the attention function transformers models call through `AttentionInterface`.

The model runs on a flattened ragged batch: `input_ids`/`position_ids` of shape [1, T] hold every sequence's new
tokens back to back, and no Hugging Face cache is used. Each attention layer writes the new keys/values into the
block pool at `slot_mapping`, then, sequence by sequence, gathers that sequence's whole context from its block
table and runs SDPA with a causal mask offset by the tokens already in cache. Per-sequence attention keeps a
sequence's numbers independent of what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "specmesh_paged"


class PagedKVCache:
    """One key and one value tensor per layer: [num_blocks * block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.key_caches = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a ragged batch."""

    query_start: int          # offset of its first new token in the flattened batch
    query_len: int            # number of new tokens
    kv_slots: torch.Tensor    # [context_len] slot ids of all its tokens (cached + new), in position order


@dataclass(frozen=True)
class PagedBatch:
    """What every attention layer needs to read and write the block pool for one forward."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor    # [T] slot of each new token
    seqs: tuple[SeqSlice, ...]
    rowwise: bool = False         # one 1-query SDPA call per token: bit-identical to a 1-token decode step


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,        # [1, H, T, D] after RoPE
    key: torch.Tensor,          # [1, kvH, T, D] after RoPE
    value: torch.Tensor,        # [1, kvH, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_batch: PagedBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if paged_batch is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the `paged_batch` keyword argument")
    if kwargs.get("sliding_window"):
        raise NotImplementedError("sliding-window attention is not supported by the paged KV cache")
    layer = module.layer_idx
    k_cache = paged_batch.cache.key_caches[layer]
    v_cache = paged_batch.cache.value_caches[layer]
    k_cache[paged_batch.slot_mapping] = key[0].transpose(0, 1).to(k_cache.dtype)
    v_cache[paged_batch.slot_mapping] = value[0].transpose(0, 1).to(v_cache.dtype)

    outputs = []
    for seq in paged_batch.seqs:
        q = query[0, :, seq.query_start:seq.query_start + seq.query_len]      # [H, q, D]
        k = k_cache[seq.kv_slots].transpose(0, 1)                                # [kvH, ctx, D]
        v = v_cache[seq.kv_slots].transpose(0, 1)
        context_len = k.shape[1]
        if paged_batch.rowwise:
            outputs.append(_rowwise(q, k.to(q.dtype), v.to(q.dtype), scaling))
            continue
        # Query i sits at position (context_len - query_len + i) and sees keys 0..that position.
        q_pos = torch.arange(context_len - seq.query_len, context_len).unsqueeze(1)
        mask = torch.arange(context_len).unsqueeze(0) <= q_pos                   # [q, ctx]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype), attn_mask=mask,
            scale=scaling, enable_gqa=q.shape[0] != k.shape[0],
        )
        outputs.append(out[0])                                                   # [H, q, D]
    attn = torch.cat(outputs, dim=1)                                             # [H, T, D]
    return attn.transpose(0, 1).unsqueeze(0).contiguous(), None                  # [1, T, H, D]


def _rowwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """q [H, n, D] for the last n of ctx positions; k, v [kvH, ctx, D]. Query i sees keys [0, ctx - n + i]."""
    num_new, context_len = q.shape[1], k.shape[1]
    gqa = q.shape[0] != k.shape[0]
    rows = [F.scaled_dot_product_attention(q[None, :, i:i + 1], k[None, :, :context_len - num_new + i + 1],
                                           v[None, :, :context_len - num_new + i + 1], scale=scaling,
                                           enable_gqa=gqa)[0] for i in range(num_new)]
    return torch.cat(rows, dim=1)                                                 # [H, n, D]


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
