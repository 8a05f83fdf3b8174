"""Tests for specmesh.engine.block_manager (plain-int paged KV block manager)."""

from __future__ import annotations

import copy

import pytest

from specmesh.engine import block_manager as bm_mod
from specmesh.engine.block_manager import BlockManager, OutOfBlocksError


def snapshot(bm: BlockManager) -> tuple:
    """Deep copy of all internal state, to assert that failed operations change nothing."""
    return (
        list(bm._refcount),
        list(bm._free),
        list(bm._evictable),
        dict(bm._cache),
        dict(bm._block_hash),
        copy.deepcopy(bm._seqs),
        bm.num_free_blocks,
    )


def _run_prompt(bm: BlockManager, seq_id: int, prompt: list[int], verify: bool = True) -> int:
    """Allocate, reserve the uncached rest of the prompt, optionally mark it verified."""
    cached = bm.allocate(seq_id, prompt)
    bm.append(seq_id, len(prompt) - cached)
    if verify:
        bm.mark_verified(seq_id, prompt)
    bm.check_invariants()
    return cached


# --------------------------------------------------------------------------------- basics
def test_allocate_append_slot_mapping_truncate_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    assert bm.num_blocks_needed(0) == 0 and bm.num_blocks_needed(4) == 1 and bm.num_blocks_needed(5) == 2
    assert bm.allocate(1, list(range(10))) == 0
    assert bm.has_seq(1) and not bm.has_seq(2)
    assert bm.block_table(1) == [] and bm.num_tokens(1) == 0
    assert bm.append(1, 10) == list(range(10))
    assert bm.block_table(1) == [0, 1, 2]
    assert bm.num_tokens(1) == 10 and bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert bm.append(1, 3) == [10, 11, 12]  # position 12 opens block 3
    assert bm.block_table(1) == [0, 1, 2, 3]
    assert bm.slot_mapping(1, 8, 13) == [8, 9, 10, 11, 12]
    assert bm.append(1, 0) == []
    bm.check_invariants()

    bm.truncate(1, 6)  # rollback: blocks 2 and 3 released
    assert bm.num_tokens(1) == 6 and bm.block_table(1) == [0, 1] and bm.num_free_blocks == 6
    assert bm.append(1, 3) == [6, 7, 16]  # refills block 1, then the oldest free block (4)
    bm.check_invariants()
    bm.free(1)
    assert not bm.has_seq(1)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    bm.free(1)  # unknown -> no-op
    bm.check_invariants()


def test_slot_mapping_with_interleaved_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, [0])
    bm.allocate(2, [0])
    assert bm.append(1, 2) == [0, 1]  # block 0
    assert bm.append(2, 5) == [4, 5, 6, 7, 8]  # blocks 1, 2
    assert bm.append(1, 4) == [2, 3, 12, 13]  # rest of block 0, then block 3
    assert bm.block_table(1) == [0, 3] and bm.block_table(2) == [1, 2]
    assert bm.slot_mapping(1, 0, 6) == [0, 1, 2, 3, 12, 13]
    assert bm.slot_mapping(2, 3, 5) == [7, 8]
    with pytest.raises(ValueError):
        bm.slot_mapping(1, 0, 7)
    bm.check_invariants()


def test_errors() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate(1, [1, 2, 3])
    with pytest.raises(ValueError):
        bm.allocate(1, [1])
    bm.append(1, 3)
    with pytest.raises(ValueError):
        bm.mark_verified(1, [1, 2, 3, 4])  # more verified ids than KV slots
    bm.mark_verified(1, [1, 2, 3])  # hashes block 0 only
    with pytest.raises(ValueError):
        bm.truncate(1, 1)  # below the hashed verified prefix
    with pytest.raises(ValueError):
        bm.truncate(1, 4)  # grow via truncate
    bm.truncate(1, 2)  # exactly the hashed prefix is fine
    assert bm.block_table(1) == [0]
    with pytest.raises(KeyError):
        bm.append(99, 1)
    bm.check_invariants()


# --------------------------------------------------------------------------------- prefix cache
PROMPT = [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # 3 full blocks of 4 + 1 token


def test_prefix_sharing_and_revival() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert _run_prompt(bm, 1, PROMPT) == 0
    t1 = bm.block_table(1)
    assert bm.num_used_blocks == 4
    assert bm.num_cached_prefix_tokens(PROMPT) == 12

    assert _run_prompt(bm, 2, PROMPT) == 12
    t2 = bm.block_table(2)
    assert t2[:3] == t1[:3] and t2[3] != t1[3]  # shared prefix, private last block
    assert bm.num_used_blocks == 5  # 3 shared (refcount 2) + 2 private
    assert bm._refcount[t1[0]] == 2

    # the last prompt token is always recomputed: a 12-token prompt only gets 8 from cache
    assert bm.num_cached_prefix_tokens(PROMPT[:12]) == 8
    assert bm.num_cached_prefix_tokens(PROMPT[:9]) == 8
    assert bm.num_cached_prefix_tokens(PROMPT[:8]) == 4
    assert bm.num_cached_prefix_tokens(PROMPT[:1]) == 0
    assert bm.num_cached_prefix_tokens([]) == 0

    bm.free(1)
    assert bm.num_used_blocks == 4 and bm.block_table(2)[:3] == t1[:3]
    bm.free(2)
    bm.check_invariants()
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    assert bm.num_cached_prefix_tokens(PROMPT) == 12  # evictable, still cached

    assert bm.allocate(3, PROMPT) == 12  # revived
    assert bm.block_table(3) == t1[:3]
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    bm.check_invariants()


def test_unverified_tokens_are_never_shared() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    _run_prompt(bm, 1, PROMPT, verify=False)
    assert bm.num_cached_prefix_tokens(PROMPT) == 0
    assert _run_prompt(bm, 2, PROMPT, verify=False) == 0
    bm.mark_verified(1, PROMPT[:6])  # only the first full block is verified
    assert bm.num_cached_prefix_tokens(PROMPT) == 4
    bm.mark_verified(1, PROMPT[:8])
    assert bm.num_cached_prefix_tokens(PROMPT) == 8
    bm.free(1)
    bm.free(2)
    assert bm.num_cached_prefix_tokens(PROMPT) == 8
    bm.check_invariants()


def test_hash_chain_depends_on_parent() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    _run_prompt(bm, 1, [1, 1, 2, 2, 9])
    assert bm.num_cached_prefix_tokens([1, 1, 2, 2, 5]) == 4
    assert bm.num_cached_prefix_tokens([3, 3, 2, 2, 9]) == 0  # same block tokens, other parent
    assert bm.num_cached_prefix_tokens([1, 1, 3, 3, 9]) == 2


def test_hash_collision_does_not_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_mod, "_hash_block", lambda parent, tokens: b"x" * 32)
    bm = BlockManager(num_blocks=8, block_size=2)
    _run_prompt(bm, 1, [1, 2, 3, 4, 5])
    assert bm.num_cached_prefix_tokens([1, 2, 9]) == 2
    assert bm.num_cached_prefix_tokens([5, 6, 7]) == 0  # same (fake) hash, different tokens
    assert bm.allocate(2, [5, 6, 7]) == 0
    bm.check_invariants()


def test_duplicate_block_keeps_own_block_unregistered() -> None:
    bm = BlockManager(num_blocks=12, block_size=4)
    # both sequences compute the same prompt before either is verified
    assert bm.allocate(1, PROMPT) == 0 and bm.allocate(2, PROMPT) == 0
    bm.append(1, len(PROMPT))
    bm.append(2, len(PROMPT))
    bm.mark_verified(1, PROMPT)
    bm.mark_verified(2, PROMPT)  # identical blocks already cached: seq 2 keeps its own blocks
    bm.check_invariants()
    t1, t2 = bm.block_table(1), bm.block_table(2)
    assert set(t1).isdisjoint(t2)
    assert _run_prompt(bm, 3, PROMPT) == 12 and bm.block_table(3)[:3] == t1[:3]
    with pytest.raises(ValueError):
        bm.truncate(2, 11)  # seq 2's verified prefix is still protected
    bm.free(2)  # its unregistered blocks go straight back to the free list
    assert len(bm._free) == 12 - 4 - 1 and not bm._evictable
    bm.free(1)
    bm.free(3)
    assert bm.num_free_blocks == 12 and len(bm._evictable) == 3
    bm.check_invariants()


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    _run_prompt(bm, 1, PROMPT)
    assert bm.num_cached_prefix_tokens(PROMPT) == 0
    assert _run_prompt(bm, 2, PROMPT) == 0
    with pytest.raises(ValueError):
        bm.truncate(1, 11)  # verified floor still enforced
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 8 and not bm._evictable


def test_eviction_is_lru_and_drops_hash() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    _run_prompt(bm, 1, [1, 1, 9])  # blocks 0 (hashed), 1
    _run_prompt(bm, 2, [2, 2, 9])  # blocks 2 (hashed), 3
    bm.free(1)  # block 0 -> evictable first (least recently freed)
    bm.free(2)
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 0
    assert bm.num_cached_prefix_tokens([1, 1, 9]) == 2 and bm.num_cached_prefix_tokens([2, 2, 9]) == 2

    assert bm.allocate(3, [3] * 8) == 0
    bm.append(3, 4)  # uses the two never-hashed free blocks first
    assert sorted(bm.block_table(3)) == [1, 3]
    assert bm.num_cached_prefix_tokens([1, 1, 9]) == 2 and bm.num_cached_prefix_tokens([2, 2, 9]) == 2
    bm.append(3, 2)  # pool otherwise exhausted -> evicts LRU cached block 0
    assert bm.block_table(3)[-1] == 0
    assert bm.num_cached_prefix_tokens([1, 1, 9]) == 0
    assert bm.num_cached_prefix_tokens([2, 2, 9]) == 2
    assert bm.allocate(4, [1, 1, 9]) == 0  # evicted hash no longer hits
    bm.append(3, 2)
    assert bm.block_table(3)[-1] == 2 and bm.num_cached_prefix_tokens([2, 2, 9]) == 0
    bm.check_invariants()
    assert bm.num_free_blocks == 0


def test_out_of_blocks_leaves_state_unchanged() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    _run_prompt(bm, 1, PROMPT[:9])  # 3 blocks, 2 hashed
    bm.allocate(2, [5, 5])
    bm.append(2, 3)  # last block
    assert bm.num_free_blocks == 0
    before = snapshot(bm)
    assert not bm.can_append(2, 2)
    with pytest.raises(OutOfBlocksError):
        bm.append(2, 2)
    with pytest.raises(OutOfBlocksError):
        bm.append(1, 10)
    assert snapshot(bm) == before
    assert bm.can_append(2, 1) and bm.append(2, 1) == [bm.block_table(2)[0] * 4 + 3]  # fits in-block
    bm.check_invariants()
