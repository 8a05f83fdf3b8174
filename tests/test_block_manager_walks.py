"""Random walks over specmesh.engine.block_manager: a hypothesis state machine with a shadow model of the KV
contents, and a long seeded walk over many sequences (plain ints, no torch)."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specmesh.engine.block_manager import BlockManager, OutOfBlocksError
from tests.test_block_manager import snapshot


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/append/truncate/verify/free with a shadow model of the KV contents.

    The fake KV store maps each slot to the full token prefix whose KV it holds; every live sequence
    must always see its own prefixes in its slots (so shared blocks are never overwritten and prefix
    hits serve correct KV).
    """

    @initialize(num_blocks=st.integers(4, 16), block_size=st.sampled_from([1, 2, 4]), caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.tokens: dict[int, list[int]] = {}
        self.verified: dict[int, int] = {}
        self.floor: dict[int, int] = {}  # hashed verified prefix (block aligned)
        self.kv: dict[int, tuple[int, ...]] = {}
        self.ever_verified: set[tuple[int, ...]] = set()
        self.next_id = 0

    def _write(self, seq_id: int, slots: list[int], new: list[int]) -> None:
        toks = self.tokens[seq_id]
        for slot, tok in zip(slots, new, strict=True):
            toks.append(tok)
            self.kv[slot] = tuple(toks)

    @rule(prompt=st.lists(st.integers(0, 1), max_size=10))
    def allocate(self, prompt: list[int]) -> None:
        sid = self.next_id
        self.next_id += 1
        expected = self.bm.num_cached_prefix_tokens(prompt)
        n = self.bm.allocate(sid, prompt)
        assert n == expected and n % self.bs == 0 and n <= max(0, len(prompt) - 1)
        assert tuple(prompt[:n]) in self.ever_verified or n == 0
        for p, slot in enumerate(self.bm.slot_mapping(sid, 0, n)):
            assert self.kv[slot] == tuple(prompt[: p + 1])  # shared KV is the right KV
        self.tokens[sid], self.verified[sid], self.floor[sid] = list(prompt[:n]), n, n
        if self.bm.can_append(sid, len(prompt) - n):
            self._write(sid, self.bm.append(sid, len(prompt) - n), prompt[n:])
        else:
            before = snapshot(self.bm)
            with pytest.raises(OutOfBlocksError):
                self.bm.append(sid, len(prompt) - n)
            assert snapshot(self.bm) == before
            self.free(sid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 1), max_size=6))
    def append(self, data: st.DataObject, new: list[int]) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.bm.can_append(sid, len(new)):
            self._write(sid, self.bm.append(sid, len(new)), new)
        else:
            before = snapshot(self.bm)
            with pytest.raises(OutOfBlocksError):
                self.bm.append(sid, len(new))
            assert snapshot(self.bm) == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        n = data.draw(st.integers(self.floor[sid], len(self.tokens[sid])))
        self.bm.truncate(sid, n)
        del self.tokens[sid][n:]
        self.verified[sid] = min(self.verified[sid], n)
        if self.floor[sid] > 0:
            with pytest.raises(ValueError):
                self.bm.truncate(sid, self.floor[sid] - 1)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def mark_verified(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[sid]
        v = data.draw(st.integers(self.verified[sid], len(toks)))
        self.bm.mark_verified(sid, toks[:v])
        self.verified[sid] = v
        self.floor[sid] = max(self.floor[sid], v // self.bs * self.bs)
        for k in range(0, v + 1, self.bs):
            self.ever_verified.add(tuple(toks[:k]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free_seq(self, data: st.DataObject) -> None:
        self.free(data.draw(st.sampled_from(sorted(self.tokens))))

    def free(self, sid: int) -> None:
        self.bm.free(sid)
        del self.tokens[sid], self.verified[sid], self.floor[sid]

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        for sid, toks in self.tokens.items():
            assert self.bm.num_tokens(sid) == len(toks)
            for p, slot in enumerate(self.bm.slot_mapping(sid, 0, len(toks))):
                assert self.kv[slot] == tuple(toks[: p + 1])

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for sid in list(self.tokens):
            self.free(sid)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks and self.bm.num_used_blocks == 0


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_random_ops_long_run() -> None:
    """A longer seeded random walk over many sequences, complementing the stateful test."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=24, block_size=2)
    live: dict[int, list[int]] = {}
    verified: dict[int, int] = {}
    hits = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.25 or not live:
            prompt = [rng.randint(0, 1) for _ in range(rng.randint(1, 9))]
            n = bm.allocate(step, prompt)
            hits += n > 0
            live[step], verified[step] = list(prompt[:n]), n
            if bm.can_append(step, len(prompt) - n):
                bm.append(step, len(prompt) - n)
                live[step] = list(prompt)
        else:
            sid = rng.choice(sorted(live))
            toks = live[sid]
            if op < 0.5:
                k = rng.randint(0, 5)
                if bm.can_append(sid, k):
                    bm.append(sid, k)
                    toks.extend(rng.randint(0, 1) for _ in range(k))
            elif op < 0.7:
                floor = verified[sid] // 2 * 2
                n = rng.randint(floor, len(toks))
                bm.truncate(sid, n)
                del toks[n:]
                verified[sid] = min(verified[sid], n)
            elif op < 0.9:
                verified[sid] = rng.randint(verified[sid], len(toks))
                bm.mark_verified(sid, toks[: verified[sid]])
            else:
                bm.free(sid)
                del live[sid], verified[sid]
        bm.check_invariants()
    assert hits > 0  # the tiny alphabet must actually exercise prefix sharing
    for sid in list(live):
        bm.free(sid)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
