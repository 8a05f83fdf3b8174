"""Runs a transformers causal LM over a ragged batch with the paged KV cache. Tensors stay in here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specmesh.engine.errors import ForwardInterrupted
from specmesh.engine.int4_linear import Int4GroupLinear
from specmesh.engine.kernel_threads import kernel_threads
from specmesh.engine.paged_attention import ATTN_IMPLEMENTATION, PagedBatch, PagedKVCache, SeqSlice
from specmesh.engine.qwen2_decoder import Qwen2Decoder, is_fused, supports
from specmesh.spec.tree import block_layout


@dataclass(frozen=True)
class ForwardItem:
    """One sequence's work in a forward, on plain ints."""

    token_ids: Sequence[int]      # new tokens to run
    start_pos: int                # position of token_ids[0] (= tokens already in the KV cache)
    block_table: Sequence[int]    # KV blocks of the sequence; they cover positions 0 .. start_pos + len(token_ids) - 1
    num_logits: int               # logits wanted for the last num_logits new tokens (0 = none)
    # A token tree (specmesh/spec/tree.py) over the last len(tree_parents) + 1 new tokens (the root, then the nodes):
    # node i runs at position root + 1 + depth(i) and attends to the context, the root and its ancestors only; its KV
    # goes to the slot of its index in token_ids. None = causal.
    tree_parents: Sequence[int] | None = None


def kv_cache_geometry(model: PreTrainedModel) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder-only model."""
    cfg = model.config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or num_heads, head_dim


class ModelRunner:
    def __init__(self, model: PreTrainedModel, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype | None = None, batch_invariant: bool = False, own_forward: bool = True) -> None:
        """batch_invariant: attention one query row at a time over its own block-padded context, so a token's
        numbers never depend on how many tokens share the forward (needed with int8 / int4 per-token linears for exact
        greedy speculation). own_forward: specmesh's Qwen2 forward where it applies (see qwen2_decoder), else
        transformers' (with the same paged attention)."""
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model.train(False)                                  # eval mode
        self.batch_invariant = batch_invariant
        num_layers, num_kv_heads, head_dim = kv_cache_geometry(model)
        dtype = kv_dtype or next(model.parameters()).dtype
        self.cache = PagedKVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)
        own_cache = dtype in (torch.float32, torch.float16)             # what its rope_store writes
        self.decoder = Qwen2Decoder(model) if own_forward and own_cache and supports(model) else None
        if self.decoder is None and is_fused(model):
            raise ValueError("a model with fused projections runs only on specmesh's forward (float32 or float16 KV "
                             "cache)")
        # int4 linears run on their own thread pool: torch's ops then stay on one thread (see forward_flat)
        self.own_kernel_threads = any(isinstance(m, Int4GroupLinear) for m in model.modules())
        # Asked between layers of specmesh's forward: True abandons the forward (ForwardInterrupted). The engine sets
        # it for work that may give way (the verifier's decoding ahead); transformers' forward runs to the end.
        self.interrupt: Callable[[], bool] | None = None

    def forward(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """Returns, per item, float32 logits [num_logits, vocab] (an empty [0, vocab] tensor when none wanted)."""
        return list(torch.split(self.forward_flat(items), [item.num_logits for item in items]))

    def forward_flat(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """float32 logits [sum of num_logits, vocab]: every item's rows back to back, in item order. The thread
        budget is torch's thread count; with int4 linears it goes to the C kernels (int4 matmuls, attention), and
        torch's own (small) ops run on one thread meanwhile, so that the thread pools do not spin against each
        other."""
        threads = torch.get_num_threads()
        if threads == 1:
            return self._forward_flat(items)
        if not self.own_kernel_threads:
            # torch's pool runs the linears: the attention kernel stays on one thread (its own pool beside torch's
            # spinning one made an int8 1.5B decode at 2k positions 82 ms instead of 71 on a 2-core Zen 4)
            with kernel_threads(1):
                return self._forward_flat(items)
        torch.set_num_threads(1)
        try:
            with kernel_threads(threads):
                return self._forward_flat(items)
        finally:
            torch.set_num_threads(threads)

    @torch.inference_mode()
    def _forward_flat(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        bs = self.cache.block_size
        input_ids: list[int] = []
        position_ids: list[int] = []
        slot_mapping: list[int] = []
        seqs: list[SeqSlice] = []
        keep: list[int] = []
        for item in items:
            n = len(item.token_ids)
            start = len(input_ids)
            context_len = item.start_pos + n
            if n == 0 or len(item.block_table) * bs < context_len:
                raise ValueError(f"{len(item.block_table)} blocks must cover the context ({context_len}), n={n}")
            table = item.block_table
            input_ids.extend(item.token_ids)
            offsets, query_mask = _tree_layout(n, item.tree_parents)
            position_ids.extend(item.start_pos + o for o in offsets)
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(item.start_pos, context_len))
            seqs.append(SeqSlice(start, n, context_len, table[:-(-context_len // bs)], query_mask))
            keep.extend(range(start + n - item.num_logits, start + n))
        batch = PagedBatch.build(self.cache, torch.tensor(slot_mapping, dtype=torch.long), seqs,
                                 self.batch_invariant)
        if self.decoder is not None:
            hidden = self.decoder.forward(torch.tensor(input_ids, dtype=torch.long),
                                          torch.tensor(position_ids, dtype=torch.long), max(position_ids), batch,
                                          torch.tensor(keep, dtype=torch.long), self.interrupt)
            if self.interrupt is not None and self.interrupt():
                raise ForwardInterrupted("interrupted before the LM head")
            logits: torch.Tensor = self.model.lm_head(hidden).float()        # [sum(num_logits), vocab]
            return logits
        hidden = self.model.model(
            input_ids=torch.tensor([input_ids], dtype=torch.long),
            position_ids=torch.tensor([position_ids], dtype=torch.long),
            use_cache=False,
            paged_batch=batch,
        ).last_hidden_state                                                   # [1, T, hidden]
        logits = self.model.lm_head(hidden[0, keep]).float()                 # [sum(num_logits), vocab]
        return logits

    @torch.inference_mode()
    def move_kv(self, src_slots: Sequence[int], dst_slots: Sequence[int]) -> None:
        """Copy the keys and values at src_slots to dst_slots in every layer (all read before any is written)."""
        src = torch.tensor(src_slots, dtype=torch.long)
        dst = torch.tensor(dst_slots, dtype=torch.long)
        for cache in (*self.cache.key_caches, *self.cache.value_caches):
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, dst, flat.index_select(0, src))


def _tree_layout(num_new: int, tree_parents: Sequence[int] | None) -> tuple[list[int], torch.Tensor | None]:
    """(position offset of each new token, the [n, n] bool mask of new tokens each sees; None = causal)."""
    if tree_parents is None:
        return list(range(num_new)), None
    offsets, rows = block_layout(num_new - len(tree_parents) - 1, tree_parents)
    mask = torch.zeros(num_new, num_new, dtype=torch.bool)
    for r, visible in enumerate(rows):
        mask[r, visible] = True
    return offsets, mask
