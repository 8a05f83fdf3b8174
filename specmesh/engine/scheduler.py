"""Continuous-batching scheduler on plain ints: which sequences run how many tokens in the next forward.

Every piece of pending work is a `ForwardRequest`: run the sequence's uncomputed context tokens plus some extra
tokens (draft tokens to verify), and return logits for the last `num_logits` of them. Requests are served in
arrival order within a token budget; a prefill larger than the remaining budget is chunked (it keeps its place
and continues next step). When blocks run out, idle sequences (no pending work) are preempted first, then the
newest waiting ones; a preempted sequence frees its blocks and recomputes later (its verified full blocks usually
come back from the prefix cache).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.loop import EngineError


@dataclass
class SeqState:
    seq_id: int
    token_ids: list[int]          # context tokens (verified ones first)
    num_verified: int             # token_ids[:num_verified] are verified (hashable into the prefix cache)
    num_computed: int = 0         # tokens of token_ids whose KV is in the cache
    allocated: bool = False
    num_cached_tokens: int = 0    # tokens served from the prefix cache at the last allocation


@dataclass
class ForwardRequest:
    seq: SeqState
    extra_ids: list[int]          # tokens after token_ids to run in the same forward (not part of the context)
    num_logits: int               # >= 1: logits wanted for the last num_logits tokens
    payload: Any = None           # engine-specific (the caller's completion, sampling state, ...)
    deadline: float | None = None # time.monotonic() after which the caller no longer waits


@dataclass(frozen=True)
class ScheduledItem:
    request: ForwardRequest
    start_pos: int                # first position run
    token_ids: list[int]          # tokens run this step
    is_final: bool                # logits are produced (otherwise a prefill chunk)


@dataclass
class Scheduler:
    block_manager: BlockManager
    max_num_batched_tokens: int
    max_num_seqs: int
    waiting: list[ForwardRequest] = field(default_factory=list)
    num_preemptions: int = 0

    def schedule(self, idle_seqs: Callable[[], Iterable[SeqState]]
                 ) -> tuple[list[ScheduledItem], list[tuple[ForwardRequest, EngineError]]]:
        """Returns (items for this forward, requests that must fail: expired, or larger than the whole pool)."""
        budget = self.max_num_batched_tokens
        batch: list[ScheduledItem] = []
        failed = self._drop_expired()
        for req in list(self.waiting):
            if budget <= 0 or len(batch) >= self.max_num_seqs:
                break
            seq = req.seq
            if not seq.allocated:
                seq.num_computed = self.block_manager.allocate(seq.seq_id, seq.token_ids[: seq.num_verified])
                seq.num_cached_tokens = seq.num_computed
                seq.allocated = True
            pending = seq.token_ids[seq.num_computed:] + req.extra_ids
            is_final = len(pending) <= budget
            run_ids = pending if is_final else pending[:budget]
            if is_final and len(run_ids) < req.num_logits:
                raise ValueError("a request must run at least num_logits tokens")
            if not self._reserve(req, len(run_ids), batch, idle_seqs):
                if not batch and self._holds_only_itself(req):
                    failed.append((req, EngineError("RESOURCE_EXHAUSTED", "the sequence does not fit in the KV cache")))
                    self.waiting.remove(req)
                    continue
                break
            batch.append(ScheduledItem(req, seq.num_computed, run_ids, is_final))
            budget -= len(run_ids)
            if is_final:
                self.waiting.remove(req)
        return batch, failed

    def _drop_expired(self) -> list[tuple[ForwardRequest, EngineError]]:
        now = time.monotonic()
        expired = [r for r in self.waiting if r.deadline is not None and now > r.deadline]
        for req in expired:
            self.waiting.remove(req)
        return [(r, EngineError("DEADLINE_EXCEEDED", "the request's deadline passed while it waited")) for r in expired]

    def _reserve(self, req: ForwardRequest, num_tokens: int, batch: list[ScheduledItem],
                 idle_seqs: Callable[[], Iterable[SeqState]]) -> bool:
        bm = self.block_manager
        seq_id = req.seq.seq_id
        if bm.can_append(seq_id, num_tokens):
            bm.append(seq_id, num_tokens)
            return True
        in_batch = {item.request.seq.seq_id for item in batch} | {seq_id}
        victims = [s for s in idle_seqs() if s.allocated and s.seq_id not in in_batch]
        victims += [r.seq for r in reversed(self.waiting) if r.seq.allocated and r.seq.seq_id not in in_batch]
        for victim in victims:
            self.preempt(victim)
            if bm.can_append(seq_id, num_tokens):
                bm.append(seq_id, num_tokens)
                return True
        return False

    def _holds_only_itself(self, req: ForwardRequest) -> bool:
        """True when nothing else holds blocks, so waiting cannot help: the request is larger than the pool."""
        return self.block_manager.num_used_blocks == len(self.block_manager.block_table(req.seq.seq_id))

    def preempt(self, seq: SeqState) -> None:
        self.block_manager.free(seq.seq_id)
        seq.allocated = False
        seq.num_computed = 0
        self.num_preemptions += 1

    def commit(self, seq: SeqState) -> None:
        """After a forward: drop KV slots past num_computed (rejected drafts) and hash verified full blocks."""
        self.block_manager.truncate(seq.seq_id, seq.num_computed)
        self.block_manager.mark_verified(seq.seq_id, seq.token_ids[: min(seq.num_verified, seq.num_computed)])

    def release(self, seq: SeqState) -> None:
        self.waiting = [r for r in self.waiting if r.seq is not seq]
        if seq.allocated:
            self.block_manager.free(seq.seq_id)
            seq.allocated = False
