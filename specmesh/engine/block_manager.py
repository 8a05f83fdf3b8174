"""Paged KV-cache block manager with ref-counting and hash-chained prefix caching.

Plain-int bookkeeping only (no tensors), in the spirit of nano-vllm's / vLLM's block managers.

* The pool has ``num_blocks`` blocks of ``block_size`` token slots. The slot of position ``pos`` of a
  sequence is ``table[pos // block_size] * block_size + pos % block_size``.
* Every block is in exactly one of three states: *free* (refcount 0, never hashed / hash dropped),
  *evictable* (refcount 0 but still registered in the prefix cache, kept in LRU order) or *used*
  (refcount > 0).
* Only FULL blocks of tokens that the caller declared *verified* (``mark_verified``) are hashed.
  The hash chains ``sha256(parent_hash || tokens)``; each cache entry also stores its parent hash
  and token tuple, which are compared on every hit, so a hash collision never shares wrong KV.
* Hashed blocks are immutable: ``truncate`` may not go below the hashed prefix and ``allocate``
  only shares blocks inside ``prompt_ids[:-1]``, so new writes always land in private blocks.
* Duplicate policy: if ``mark_verified`` finds an identical block already cached (another
  sequence computed the same prefix), the sequence keeps its own block, which stays unregistered
  (no duplicate entry, the existing entry wins); the hash chain still continues through it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

_ROOT_HASH = bytes(32)


class OutOfBlocksError(Exception):
    """Not enough free blocks; raised before any state change."""


@dataclass(slots=True)
class _SeqState:
    table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_hashed_blocks: int = 0  # leading blocks covered by mark_verified/prefix hits (immutable)
    last_hash: bytes = _ROOT_HASH  # chain hash of block num_hashed_blocks - 1


@dataclass(frozen=True, slots=True)
class _CacheEntry:
    block_id: int
    parent_hash: bytes
    tokens: tuple[int, ...]


def _hash_block(parent_hash: bytes, tokens: tuple[int, ...]) -> bytes:
    return hashlib.sha256(parent_hash + ",".join(map(str, tokens)).encode()).digest()


class BlockManager:
    """Allocates KV blocks to sequences, with ref-counted prefix sharing of verified blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # refcount 0, unhashed
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, hashed; LRU first
        self._cache: dict[bytes, _CacheEntry] = {}  # chain hash -> entry
        self._block_hash: dict[int, bytes] = {}  # block id -> its registered chain hash
        self._seqs: dict[int, _SeqState] = {}

    # ----------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with refcount > 0."""
        return self.num_blocks - self.num_free_blocks

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def num_hashed_tokens(self, seq_id: int) -> int:
        """Tokens in the sequence's hashed (immutable) leading blocks: ``truncate`` cannot go below this."""
        return self._seq(seq_id).num_hashed_blocks * self.block_size

    def num_tokens(self, seq_id: int) -> int:
        return self._seq(seq_id).num_tokens

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).table)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_cached_prefix_tokens(self, prompt_ids: Sequence[int]) -> int:
        """Tokens of ``prompt_ids`` that ``allocate`` would serve from cache (no state change)."""
        return len(self._lookup(prompt_ids)[0]) * self.block_size

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        return self._blocks_to_add(self._seq(seq_id), num_new_tokens) <= self.num_free_blocks

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slot ids of positions ``[start, end)``; requires ``0 <= start <= end <= num_tokens``."""
        seq = self._seq(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(f"bad range [{start}, {end}) for seq with {seq.num_tokens} tokens")
        bs, table = self.block_size, seq.table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ----------------------------------------------------------------------------- mutations
    def allocate(self, seq_id: int, prompt_ids: Sequence[int]) -> int:
        """Register ``seq_id``, sharing the longest cached full-block prefix of ``prompt_ids[:-1]``.

        Returns the number of shared (already computed) tokens, which is also the new num_tokens.
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq {seq_id} already allocated")
        blocks, last_hash = self._lookup(prompt_ids)
        for b in blocks:
            if self._refcount[b] == 0:
                del self._evictable[b]
            self._refcount[b] += 1
        n = len(blocks) * self.block_size
        self._seqs[seq_id] = _SeqState(list(blocks), n, len(blocks), last_hash)
        return n

    def append(self, seq_id: int, num_new_tokens: int) -> list[int]:
        """Reserve ``num_new_tokens`` more slots and return their slot ids in position order."""
        seq = self._seq(seq_id)
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be >= 0")
        need = self._blocks_to_add(seq, num_new_tokens)
        if need > self.num_free_blocks:
            raise OutOfBlocksError(f"need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            seq.table.append(self._take_block())
        start = seq.num_tokens
        seq.num_tokens += num_new_tokens
        return self.slot_mapping(seq_id, start, seq.num_tokens)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Shrink to ``num_tokens`` (rollback of rejected tokens), releasing trailing blocks."""
        seq = self._seq(seq_id)
        floor = seq.num_hashed_blocks * self.block_size
        if not floor <= num_tokens <= seq.num_tokens:
            raise ValueError(f"truncate to {num_tokens} outside [{floor}, {seq.num_tokens}]")
        keep = self.num_blocks_needed(num_tokens)
        while len(seq.table) > keep:
            self._release(seq.table.pop())
        seq.num_tokens = num_tokens

    def mark_verified(self, seq_id: int, verified_ids: Sequence[int]) -> None:
        """Hash every newly full block of the verified prefix ``verified_ids`` into the prefix cache.

        Blocks already hashed for this sequence are skipped (their tokens are not re-checked).
        """
        seq = self._seq(seq_id)
        if len(verified_ids) > seq.num_tokens:
            raise ValueError(f"{len(verified_ids)} verified ids > {seq.num_tokens} tokens in KV")
        bs = self.block_size
        for i in range(seq.num_hashed_blocks, len(verified_ids) // bs):
            if self.enable_prefix_caching:
                tokens = tuple(verified_ids[i * bs : (i + 1) * bs])
                h = _hash_block(seq.last_hash, tokens)
                if h not in self._cache:  # else keep own block unregistered (see module doc)
                    block = seq.table[i]
                    self._cache[h] = _CacheEntry(block, seq.last_hash, tokens)
                    self._block_hash[block] = h
                seq.last_hash = h
            seq.num_hashed_blocks = i + 1

    def free(self, seq_id: int) -> None:
        """Release all blocks of ``seq_id`` (tail first, so tails are evicted first); unknown -> no-op."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            for b in reversed(seq.table):
                self._release(b)

    # ----------------------------------------------------------------------------- internals
    def _seq(self, seq_id: int) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown seq {seq_id}") from None

    def _blocks_to_add(self, seq: _SeqState, num_new_tokens: int) -> int:
        return max(0, self.num_blocks_needed(seq.num_tokens + num_new_tokens) - len(seq.table))

    def _lookup(self, prompt_ids: Sequence[int]) -> tuple[list[int], bytes]:
        """Longest chain of cached full blocks inside ``prompt_ids[:-1]``, and its last hash."""
        blocks: list[int] = []
        h = _ROOT_HASH
        if not self.enable_prefix_caching:
            return blocks, h
        bs = self.block_size
        for i in range(max(0, len(prompt_ids) - 1) // bs):
            tokens = tuple(prompt_ids[i * bs : (i + 1) * bs])
            nxt = _hash_block(h, tokens)
            entry = self._cache.get(nxt)
            if entry is None or entry.tokens != tokens or entry.parent_hash != h:
                break
            blocks.append(entry.block_id)
            h = nxt
        return blocks, h

    def _take_block(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._cache[self._block_hash.pop(b)]
        self._refcount[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._refcount[b] -= 1
        if self._refcount[b] == 0:
            if b in self._block_hash:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def check_invariants(self) -> None:
        """Assert internal consistency (refcounts, pool partition, cache maps, table sizes)."""
        counts = [0] * self.num_blocks
        for sid, seq in self._seqs.items():
            assert len(set(seq.table)) == len(seq.table), f"seq {sid}: duplicate block in table"
            assert len(seq.table) == self.num_blocks_needed(seq.num_tokens), f"seq {sid}: table size"
            assert seq.num_hashed_blocks * self.block_size <= seq.num_tokens, f"seq {sid}: hashed"
            for b in seq.table:
                counts[b] += 1
        assert counts == self._refcount, "refcounts != table references"
        free, evictable = set(self._free), set(self._evictable)
        used = {b for b in range(self.num_blocks) if self._refcount[b] > 0}
        assert len(free) == len(self._free), "duplicate in free list"
        assert not (free & evictable) and not (free & used) and not (evictable & used)
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "pool not partitioned"
        assert all(b not in self._block_hash for b in free), "free block still hashed"
        assert all(b in self._block_hash for b in evictable), "evictable block not hashed"
        assert len(self._cache) == len(self._block_hash)
        for b, h in self._block_hash.items():
            assert self._cache[h].block_id == b, "cache / block-hash maps disagree"
