"""Paged KV storage and the attention function transformers models call through `AttentionInterface`.

The model runs on a flattened ragged batch: `input_ids`/`position_ids` of shape [1, T] hold every sequence's new
tokens back to back, and no Hugging Face cache is used. Each attention layer writes the new keys/values into the
block pool at `slot_mapping` (new tokens only), gathers every sequence's context by block (one indexing op for the
whole batch), then attends. The masks and index tensors are built once per forward (`PagedBatch.build`) and reused
by every layer.

Two ways to attend:

* batched (float models): one masked SDPA call over the whole batch, queries and keys padded to the longest.
* rowwise (batch-invariant, int8 and int4 models): with a float32 or float16 cache, `attention_kernel.c` runs every
  new token as its own row over the list of its key slots, read straight from the block pool (no gather, no padding;
  built once per forward in `RowKeys`); its sums run in an order fixed by the row's own keys. Without the kernel (no
  C compiler, another dtype), every new token is its own 1-query SDPA row over its own context (keys and values in
  the query's dtype) padded to `L = ceil(context / bucket) * bucket` keys (bucket: 64 tokens rounded up to whole
  blocks). A one-token decode runs the same row, so a token's numbers are bit-identical whether it is verified in a
  block of k, decoded alone, or shares the forward with other sequences (SDPA's output for a 1-query row depends only
  on that row's keys and key length, checked in tests/test_batched_attention.py). The rows of one sequence that share
  a key length run in one call over that sequence's keys (expanded, not copied).

Tree verification hook: `SeqSlice.query_mask` [q, q] bool says which new tokens each new token sees (None = causal;
for a tree: its ancestors and itself, in topological order); the new tokens' position ids are the runner's business.
Every new token always sees the whole cached context. In rowwise mode a tree token's keys are gathered contiguously
(context, then its path), so its numbers equal a one-token decode of its path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from specmesh.engine import attention_kernel
from specmesh.engine.huge_pages import huge_page_zeros

ATTN_IMPLEMENTATION = "specmesh_paged"
ROW_KEY_BUCKET = 64


class PagedKVCache:
    """One key and one value tensor per layer: [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # One mapping advised for huge pages (huge_pages.py): a long context's decode reads its KV every layer. Backed
        # whole at start: backed as blocks were first used instead, a step whose blocks reached fresh 2 MiB pages of
        # every layer's keys and values waited for the kernel to zero (and compact memory for) 56 of them, ~250 ms
        # on a 2-core Zen 4 (THP defrag "madvise"), a stall for every stream in that step.
        caches = huge_page_zeros([shape] * (2 * num_layers), dtype)
        self.key_caches, self.value_caches = caches[0::2], caches[1::2]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value [T, kvH, D] of the new tokens, stored at their slots."""
        k_cache, v_cache = self.key_caches[layer], self.value_caches[layer]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables [B, nb] -> keys, values [B, nb * block_size, kvH, D] (one copy per forward and layer)."""
        k_cache, v_cache = self.key_caches[layer], self.value_caches[layer]
        b, nb = block_tables.shape
        flat = block_tables.view(-1)            # index_select copies whole blocks (advanced indexing is ~10x slower)
        return (k_cache.index_select(0, flat).view(b, nb * self.block_size, *k_cache.shape[2:]),
                v_cache.index_select(0, flat).view(b, nb * self.block_size, *v_cache.shape[2:]))


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a ragged batch, on plain ints."""

    query_start: int          # offset of its first new token in the flattened batch
    query_len: int            # number of new tokens
    context_len: int          # cached + new tokens; the new ones have key indices context_len - query_len ...
    block_table: Sequence[int]                  # KV blocks covering its context, in position order
    query_mask: torch.Tensor | None = None      # [q, q] bool: new token i sees new token j (None = causal)


@dataclass(frozen=True)
class _RowGroup:
    """Rows [row_start, row_end) of the flattened batch: one sequence's new tokens whose key length is key_len."""

    seq_index: int
    row_start: int
    row_end: int
    key_len: int
    mask: torch.Tensor        # [rows, 1, 1, key_len] bool
    key_index: torch.Tensor | None = None   # [rows, key_len]: each row's own keys (trees); None = keys 0..key_len-1


@dataclass(frozen=True)
class RowKeys:
    """The attention kernel's view of a forward: row t (a new token) attends to key_slots[row_start[t] : row_start[t]
    + row_len[t]], its keys in order (context, then its own new tokens or tree path)."""

    key_slots: torch.Tensor       # [sum of slot lists] int32
    row_start: torch.Tensor       # [T] int64
    row_len: torch.Tensor         # [T] int64
    max_len: int

    @staticmethod
    def build(seqs: Sequence[SeqSlice], block_size: int) -> RowKeys:
        slot_lists: list[torch.Tensor] = []
        starts: list[torch.Tensor] = []
        lengths: list[torch.Tensor] = []
        offset = 0
        for seq in seqs:
            first_new = seq.context_len - seq.query_len
            positions = torch.arange(seq.context_len)
            slots = torch.tensor(seq.block_table, dtype=torch.long)[positions // block_size] * block_size + \
                positions % block_size
            if seq.query_mask is None:           # chains share one slot list: row i sees its first first_new + i + 1
                slot_lists.append(slots)
                starts.append(torch.full((seq.query_len,), offset, dtype=torch.long))
                lengths.append(torch.arange(first_new + 1, seq.context_len + 1))
                offset += seq.context_len
                continue
            for i in range(seq.query_len):        # tree rows: the context, then the row's ancestors and itself
                own = torch.cat([slots[:first_new], slots[first_new + torch.nonzero(seq.query_mask[i]).flatten()]])
                slot_lists.append(own)
                starts.append(torch.tensor([offset]))
                lengths.append(torch.tensor([len(own)]))
                offset += len(own)
        row_len = torch.cat(lengths)
        return RowKeys(torch.cat(slot_lists).to(torch.int32), torch.cat(starts), row_len, int(row_len.max()))


@dataclass(frozen=True)
class PagedBatch:
    """What every attention layer needs to read and write the block pool for one forward (built once)."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor    # [T] slot of each new token
    seqs: tuple[SeqSlice, ...]
    rowwise: bool                 # batch-invariant rows (see module doc)
    block_tables: torch.Tensor    # [B, max blocks] padded with block 0 (masked out)
    mask: torch.Tensor | None     # batched mode: [B, 1, max q, max keys] bool
    uniform_query_len: bool       # batched mode: every sequence runs the same number of new tokens
    row_groups: tuple[_RowGroup, ...]
    row_keys: RowKeys | None = None   # rowwise through attention_kernel (then no tables, masks or row groups)

    @staticmethod
    def build(cache: PagedKVCache, slot_mapping: torch.Tensor, seqs: Sequence[SeqSlice],
              rowwise: bool = False) -> PagedBatch:
        if rowwise and attention_kernel.supports(cache.key_caches[0].shape[-1], cache.key_caches[0].dtype):
            return PagedBatch(cache, slot_mapping, tuple(seqs), True, torch.empty(0, dtype=torch.long), None, False,
                              (), RowKeys.build(seqs, cache.block_size))
        bucket = key_bucket(cache.block_size)
        max_blocks = max(len(s.block_table) for s in seqs)
        if rowwise:      # room for every row's padded key length (padding reads block 0, masked out)
            max_blocks = max(max_blocks, max(-(-s.context_len // bucket) * bucket for s in seqs) // cache.block_size)
        tables = torch.tensor([[*s.block_table, *[0] * (max_blocks - len(s.block_table))] for s in seqs],
                              dtype=torch.long)
        if rowwise:
            groups = tuple(g for i, s in enumerate(seqs) for g in _row_groups(i, s, bucket))
            return PagedBatch(cache, slot_mapping, tuple(seqs), True, tables, None, False, groups)
        max_q = max(s.query_len for s in seqs)
        mask = torch.stack([_seq_mask(s, max_q, max_blocks * cache.block_size) for s in seqs]).unsqueeze(1)
        uniform = all(s.query_len == max_q for s in seqs)
        return PagedBatch(cache, slot_mapping, tuple(seqs), False, tables, mask, uniform, ())


def _visible(seq: SeqSlice, rows: range, key_len: int) -> torch.Tensor:
    """[len(rows), key_len] bool: new token i (of `rows`) sees keys 0 .. context_len - query_len + i, and among the
    new keys only those its query_mask allows."""
    first_new = seq.context_len - seq.query_len
    rows_t = torch.tensor(list(rows), dtype=torch.long).unsqueeze(1)
    keys = torch.arange(key_len).unsqueeze(0)
    mask = keys <= first_new + rows_t
    if seq.query_mask is not None:
        new_cols = min(key_len, seq.context_len) - first_new
        mask[:, first_new:first_new + new_cols] &= seq.query_mask[rows.start:rows.stop, :new_cols]
    return mask


def _seq_mask(seq: SeqSlice, max_q: int, key_len: int) -> torch.Tensor:
    """[max_q, key_len]; padded query rows see key 0 (their outputs are dropped)."""
    mask = torch.zeros(max_q, key_len, dtype=torch.bool)
    mask[:seq.query_len] = _visible(seq, range(seq.query_len), key_len)
    mask[seq.query_len:, 0] = True
    return mask


def key_bucket(block_size: int) -> int:
    """Rowwise key lengths are multiples of this (>= 64 tokens, whole blocks): a sequence's rows rarely straddle two
    lengths, so most sequences take one SDPA call per layer."""
    return block_size * -(-ROW_KEY_BUCKET // block_size)


def _row_groups(seq_index: int, seq: SeqSlice, bucket: int) -> list[_RowGroup]:
    """Consecutive new tokens of `seq` whose padded key length is the same. Token i sees `visible[i]` keys laid out
    contiguously from key 0: the cached context, then (chains) new tokens 0..i or (trees) its ancestors and itself
    in order, gathered by `key_index`, exactly the keys a one-token decode of its path would see."""
    first_new = seq.context_len - seq.query_len
    if seq.query_mask is None:
        new_keys = None
        visible = [first_new + i + 1 for i in range(seq.query_len)]
    else:
        new_keys = [torch.nonzero(seq.query_mask[i]).flatten() for i in range(seq.query_len)]
        visible = [first_new + len(k) for k in new_keys]
    groups: list[_RowGroup] = []
    row = 0
    while row < seq.query_len:
        key_len = -(-visible[row] // bucket) * bucket
        end = row + 1
        while end < seq.query_len and -(-visible[end] // bucket) * bucket == key_len:
            end += 1
        mask = torch.arange(key_len)[None] < torch.tensor(visible[row:end])[:, None]       # [rows, L]
        key_index = None
        if new_keys is not None:
            cached = torch.arange(first_new)
            key_index = torch.stack([F.pad(torch.cat([cached, first_new + new_keys[i]]), (0, key_len - visible[i]))
                                     for i in range(row, end)])                              # [rows, L]
        groups.append(_RowGroup(seq_index, seq.query_start + row, seq.query_start + end, key_len,
                                mask[:, None, None, :], key_index))
        row = end
    return groups


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
    layer = cast(int, module.layer_idx)     # transformers' attention modules carry their layer's index
    paged_batch.cache.write(layer, paged_batch.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    return attend(paged_batch, layer, query[0].transpose(0, 1), scaling).unsqueeze(0), None    # [1, T, H, D]


def attend(batch: PagedBatch, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """query [T, H, D] of the new tokens, whose keys and values are already in the layer's pool -> [T, H, D]."""
    if batch.row_keys is not None:
        return _kernel_rows(batch, layer, query, scaling)
    keys, values = batch.cache.gather(layer, batch.block_tables)                 # [B, L, kvH, D]
    keys, values = keys.to(query.dtype), values.to(query.dtype)
    heads_first = query.transpose(0, 1)                                          # [H, T, D]
    if batch.rowwise:
        return _rowwise(batch, heads_first, keys, values, scaling)
    return _batched(batch, heads_first, keys, values, scaling)


def _kernel_rows(batch: PagedBatch, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """query [T, H, D] -> [T, H, D], every row over its own key slots in the layer's pool."""
    rk = batch.row_keys
    assert rk is not None
    k_cache, v_cache = batch.cache.key_caches[layer], batch.cache.value_caches[layer]
    flat_shape = (-1, *k_cache.shape[2:])                                            # [slots, kvH, D]
    head_dim = query.shape[-1]
    out = attention_kernel.paged_attention(
        query.float(), k_cache.view(flat_shape), v_cache.view(flat_shape), rk.key_slots,
        rk.row_start, rk.row_len, rk.max_len, head_dim ** -0.5 if scaling is None else float(scaling))
    return out.to(query.dtype)


def _rowwise(batch: PagedBatch, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             scaling: float | None) -> torch.Tensor:
    """query [H, T, D]; keys, values [B, L, kvH, D] -> [T, H, D]. Runs on one torch thread: SDPA's multi-threaded
    path for a single row differs in the last bits, and the engine may change its thread count between steps."""
    threads = torch.get_num_threads()
    if threads == 1:
        return _rowwise_groups(batch, query, keys, values, scaling)
    torch.set_num_threads(1)
    try:
        return _rowwise_groups(batch, query, keys, values, scaling)
    finally:
        torch.set_num_threads(threads)


def _rowwise_groups(batch: PagedBatch, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scaling: float | None) -> torch.Tensor:
    gqa = query.shape[0] != keys.shape[2]
    outputs = []
    for g in batch.row_groups:
        rows = g.row_end - g.row_start
        q = query[:, g.row_start:g.row_end].transpose(0, 1).unsqueeze(2)          # [rows, H, 1, D]
        if g.key_index is not None:                                              # tree rows: own keys, packed
            k = keys[g.seq_index][g.key_index].transpose(1, 2)                     # [rows, kvH, L, D]
            v = values[g.seq_index][g.key_index].transpose(1, 2)
        else:
            k = keys[g.seq_index, :g.key_len].transpose(0, 1).expand(rows, -1, -1, -1)  # [rows, kvH, L, D]
            v = values[g.seq_index, :g.key_len].transpose(0, 1).expand(rows, -1, -1, -1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scaling, enable_gqa=gqa)
        outputs.append(out[:, :, 0])                                             # [rows, H, D]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _batched(batch: PagedBatch, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             scaling: float | None) -> torch.Tensor:
    """One SDPA call over the padded batch. query [H, T, D] -> [T, H, D]."""
    num_heads, _, head_dim = query.shape
    mask = batch.mask
    if mask is None:
        raise ValueError("a batched-mode PagedBatch has a mask")
    num_seqs, max_q = mask.shape[0], mask.shape[2]
    if batch.uniform_query_len:
        q = query.view(num_heads, num_seqs, max_q, head_dim).transpose(0, 1)     # [B, H, q, D]
    else:
        q = query.new_zeros(num_seqs, num_heads, max_q, head_dim)
        for i, s in enumerate(batch.seqs):
            q[i, :, :s.query_len] = query[:, s.query_start:s.query_start + s.query_len]
    out = F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                         scale=scaling, enable_gqa=num_heads != keys.shape[2])  # [B, H, q, D]
    out = out.transpose(1, 2)                                                    # [B, q, H, D]
    if batch.uniform_query_len:
        return out.reshape(num_seqs * max_q, num_heads, head_dim)
    return torch.cat([out[i, :s.query_len] for i, s in enumerate(batch.seqs)])


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
