"""KV-cache accounting on the real BlockManager (plain ints, no model, no stack).

Three questions, each answered by driving `specmesh.engine.block_manager.BlockManager` the way the verifier does:
* waste: slots allocated but unused per sequence, over every speculative round (goal: <= 1 partly filled block);
* capacity: sequences that fit a fixed KV budget, paged vs contiguous allocation (goal: >= 3x);
* prefix sharing: blocks held by N sessions with one system prompt, with and without prefix caching.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from specmesh.engine.block_manager import BlockManager, OutOfBlocksError

FP32_BYTES = 4
SYNTHETIC_ID_BASE = 10**9  # output ids that can never equal a real vocabulary id


@dataclass(frozen=True)
class Geometry:
    block_size: int
    bytes_per_token: int          # K and V of every layer, float32 (the engine's default dtype)
    num_blocks: int               # blocks in the KV budget
    max_model_len: int

    @property
    def budget_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class SeqTokens:
    prompt_ids: list[int]
    output_ids: list[int]


def geometry(model_dir: Path, budget_mb: int, block_size: int, max_model_len: int = 0) -> Geometry:
    """KV geometry from the model's config.json, computed as specmesh.engine.build does."""
    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * FP32_BYTES
    model_len = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
    return Geometry(block_size, per_token, budget_mb * 2**20 // (per_token * block_size),
                    min(model_len, max_model_len) if max_model_len else model_len)


def synthetic_output(seq_index: int, length: int) -> list[int]:
    """Distinct made-up output ids (conservative for sharing: no two sequences' outputs match)."""
    return [SYNTHETIC_ID_BASE + seq_index * 100_000 + j for j in range(length)]


def admit(bm: BlockManager, seq_id: int, seq: SeqTokens) -> None:
    """Allocate a finished sequence (prefix-cache lookup on its prompt) and register its verified blocks."""
    shared = bm.allocate(seq_id, seq.prompt_ids)
    ids = seq.prompt_ids + seq.output_ids
    bm.append(seq_id, len(ids) - shared)
    bm.mark_verified(seq_id, ids)


# ------------------------------------------------------------------------------------------------- waste
def _partly_filled(bm: BlockManager, seq_id: int) -> int:
    """Blocks of the sequence whose slots are not all in use, counted from the real slot mapping."""
    used = Counter(slot // bm.block_size for slot in bm.slot_mapping(seq_id, 0, bm.num_tokens(seq_id)))
    return sum(1 for b in bm.block_table(seq_id) if used[b] < bm.block_size)


def _accepted_per_round(num_draft: int, accept_rate: float, rounds: int) -> list[int]:
    """A deterministic acceptance pattern with the given mean (error diffusion)."""
    out, carry = [], 0.0
    for _ in range(rounds):
        carry += num_draft * accept_rate
        out.append(min(num_draft, int(carry)))
        carry -= out[-1]
    return out


def simulate_waste(seq: SeqTokens, geo: Geometry, num_draft: int, accept_rate: float) -> dict[str, int]:
    """Prefill, then verify rounds (append 1 + k, truncate to the accepted length) as the verifier does."""
    bm = BlockManager(geo.num_blocks, geo.block_size)
    bm.allocate(0, seq.prompt_ids)
    bm.append(0, len(seq.prompt_ids))
    max_partly, peak_blocks, verified = _partly_filled(bm, 0), bm.num_used_blocks, len(seq.prompt_ids)
    produced = 1  # the prefill samples the first token; it enters the KV in the next round
    for accepted in _accepted_per_round(num_draft, accept_rate, len(seq.output_ids)):
        if produced >= len(seq.output_ids):
            break
        bm.append(0, 1 + num_draft)
        peak_blocks = max(peak_blocks, bm.num_used_blocks)
        step = min(accepted, len(seq.output_ids) - produced - 1)
        bm.truncate(0, verified + 1 + step)
        verified, produced = verified + 1 + step, produced + 1 + step
        max_partly = max(max_partly, _partly_filled(bm, 0))
    blocks = len(bm.block_table(0))
    return {"tokens_in_kv": bm.num_tokens(0), "blocks": blocks, "max_partly_filled_blocks": max_partly,
            "waste_slots": blocks * geo.block_size - bm.num_tokens(0), "peak_blocks_during_verify": peak_blocks}


def waste_report(seqs: Sequence[SeqTokens], geo: Geometry, num_draft: int, accept_rate: float) -> dict[str, Any]:
    rows = [simulate_waste(s, geo, num_draft, accept_rate) for s in seqs]
    waste = [r["waste_slots"] for r in rows]
    used = sum(r["tokens_in_kv"] for r in rows)
    return {"num_draft_tokens": num_draft, "accept_rate": accept_rate,
            "max_partly_filled_blocks_per_seq": max(r["max_partly_filled_blocks"] for r in rows),
            "mean_waste_slots_per_seq": statistics.mean(waste),
            "mean_waste_bytes_per_seq": statistics.mean(waste) * geo.bytes_per_token,
            "waste_fraction": sum(waste) / (sum(waste) + used), "goal_met": all(
                r["max_partly_filled_blocks"] <= 1 for r in rows), "per_seq": rows}


# ------------------------------------------------------------------------------------------------- capacity
def paged_capacity(seqs: Sequence[SeqTokens], geo: Geometry, prefix_caching: bool) -> int:
    """Sequences (the workload's, cycled) admitted until the block pool is exhausted."""
    bm = BlockManager(geo.num_blocks, geo.block_size, enable_prefix_caching=prefix_caching)
    count = 0
    while True:
        base = seqs[count % len(seqs)]
        seq = SeqTokens(base.prompt_ids, synthetic_output(count, len(base.output_ids)))
        try:
            admit(bm, count, seq)
        except OutOfBlocksError:
            return count
        count += 1


def capacity_report(seqs: Sequence[SeqTokens], geo: Geometry, max_new_tokens: int) -> dict[str, Any]:
    contiguous = geo.budget_tokens // geo.max_model_len
    reserved = statistics.mean(len(s.prompt_ids) + max_new_tokens for s in seqs)
    paged = paged_capacity(seqs, geo, prefix_caching=False)
    lens = [n for n in (geo.max_model_len, 8192, 4096, 2048) if n <= geo.max_model_len]
    return {
        "budget_tokens": geo.budget_tokens, "num_blocks": geo.num_blocks, "max_model_len": geo.max_model_len,
        "contiguous_max_model_len": contiguous,
        "contiguous_by_len": {n: geo.budget_tokens // n for n in dict.fromkeys(lens)},
        "contiguous_prompt_plus_max_new_tokens": int(geo.budget_tokens // reserved),
        "paged": paged, "paged_prefix_caching": paged_capacity(seqs, geo, prefix_caching=True),
        "paged_vs_contiguous": paged / contiguous if contiguous else None,  # None: contiguous fits nothing
        "goal_met": contiguous == 0 or paged >= 3 * contiguous,
    }


# ------------------------------------------------------------------------------------------------- sharing
def blocks_held(seqs: Sequence[SeqTokens], block_size: int, prefix_caching: bool) -> int:
    need = sum(-(-(len(s.prompt_ids) + len(s.output_ids)) // block_size) for s in seqs)
    bm = BlockManager(need + 1, block_size, enable_prefix_caching=prefix_caching)
    for i, seq in enumerate(seqs):
        admit(bm, i, seq)
    return bm.num_used_blocks


def sharing_report(sessions: Sequence[list[int]], output_len: int, block_size: int,
                   counts: Sequence[int]) -> dict[str, Any]:
    """`sessions`: prompt ids of sessions that share one system prompt; the first n of them for each count."""
    rows = []
    for n in counts:
        seqs = [SeqTokens(sessions[i], synthetic_output(i, output_len)) for i in range(n)]
        with_cache, without = blocks_held(seqs, block_size, True), blocks_held(seqs, block_size, False)
        rows.append({"sessions": n, "blocks_prefix_caching": with_cache, "blocks_no_prefix_caching": without,
                     "blocks_saved": without - with_cache, "saving": 1 - with_cache / without})
    common = _common_prefix_len(sessions)
    return {"shared_prefix_tokens": common, "shared_full_blocks": common // block_size, "rows": rows}


def _common_prefix_len(seqs: Sequence[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if len({s[i] for s in seqs}) > 1:
            return i
    return n
