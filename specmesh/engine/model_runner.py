"""Runs a transformers causal LM over a ragged batch with the paged KV cache. Tensors stay in here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specmesh.engine.paged_attention import ATTN_IMPLEMENTATION, PagedBatch, PagedKVCache, SeqSlice


@dataclass(frozen=True)
class ForwardItem:
    """One sequence's work in a forward, on plain ints."""

    token_ids: Sequence[int]      # new tokens to run
    start_pos: int                # position of token_ids[0] (= tokens already in the KV cache)
    kv_slots: Sequence[int]       # slots of positions 0 .. start_pos + len(token_ids) - 1
    num_logits: int               # logits wanted for the last num_logits new tokens (0 = none)


def kv_cache_geometry(model: PreTrainedModel) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder-only model."""
    cfg = model.config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or num_heads, head_dim


class ModelRunner:
    def __init__(self, model: PreTrainedModel, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype | None = None, batch_invariant: bool = False) -> None:
        """batch_invariant: attention one query at a time, so a token's numbers never depend on how many tokens
        share the forward (needed with int8 per-token linears for exact greedy speculation)."""
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model.eval()
        self.batch_invariant = batch_invariant
        num_layers, num_kv_heads, head_dim = kv_cache_geometry(model)
        dtype = kv_dtype or next(model.parameters()).dtype
        self.cache = PagedKVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)

    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """Returns, per item, float32 logits [num_logits, vocab] (an empty [0, vocab] tensor when none wanted)."""
        input_ids: list[int] = []
        position_ids: list[int] = []
        slot_mapping: list[int] = []
        seqs: list[SeqSlice] = []
        keep: list[int] = []
        for item in items:
            n = len(item.token_ids)
            start = len(input_ids)
            context_len = item.start_pos + n
            if len(item.kv_slots) != context_len or n == 0:
                raise ValueError(f"kv_slots ({len(item.kv_slots)}) must cover the context ({context_len}), n={n}")
            input_ids.extend(item.token_ids)
            position_ids.extend(range(item.start_pos, context_len))
            slot_mapping.extend(item.kv_slots[item.start_pos:])
            seqs.append(SeqSlice(start, n, torch.tensor(item.kv_slots, dtype=torch.long)))
            keep.extend(range(start + n - item.num_logits, start + n))
        batch = PagedBatch(self.cache, torch.tensor(slot_mapping, dtype=torch.long), tuple(seqs),
                           self.batch_invariant)
        hidden = self.model.model(
            input_ids=torch.tensor([input_ids], dtype=torch.long),
            position_ids=torch.tensor([position_ids], dtype=torch.long),
            use_cache=False,
            paged_batch=batch,
        ).last_hidden_state                                                   # [1, T, hidden]
        logits = self.model.lm_head(hidden[0, keep]).float()                 # [sum(num_logits), vocab]
        return list(torch.split(logits, [item.num_logits for item in items]))
