"""Continuous-batching scheduler on plain ints: which sequences run how many tokens in the next forward.

Every piece of pending work is a `ForwardRequest`: run the sequence's uncomputed context tokens plus some extra
tokens (draft tokens to verify), and return logits for the last `num_logits` of them (the "logits tokens": the
pending token and the drafts). The scheduler owns its queue: engines `enqueue`, `remove`, `cancel` and `release`;
nothing else edits it.

Rules (all tested in tests/test_scheduler.py without torch):

* Requests are served in arrival order within a token budget (`max_num_batched_tokens`) and `max_num_seqs`.
* A request whose tokens do not fit the remaining budget is chunked: a chunk runs only context tokens and always
  stops before the logits tokens, so the final item of a request runs all of them in one forward. A chunk keeps its
  place in the queue. A request whose logits tokens alone exceed the budget is refused at `enqueue`.
* At most one queued request per sequence.
* When blocks run out, idle sequences (no queued work) are preempted first, then the newest waiting ones (only ones
  queued after the request that needs the room); a preempted sequence frees its blocks and recomputes later (its
  verified full blocks usually come back from the prefix cache).
* A fault while scheduling one request (an EngineError, or any bug) fails that request only: it leaves the queue,
  its sequence's KV is freed, and the other requests are scheduled as usual.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.errors import EngineError

log = logging.getLogger(__name__)


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
    num_logits: int               # logits wanted for the last num_logits tokens; len(extra_ids) < num_logits
    payload: Any = None           # engine-specific (the caller's completion, sampling state, ...)
    deadline: float | None = None # time.monotonic() after which the caller no longer waits


@dataclass(frozen=True)
class ScheduledItem:
    request: ForwardRequest
    start_pos: int                # first position run
    token_ids: list[int]          # tokens run this step
    is_final: bool                # logits are produced (otherwise a prefill chunk of context tokens only)


Failure = tuple[ForwardRequest, EngineError]


class _Blocked(Exception):
    """No KV room for this request now: stop scheduling this step (later requests must not overtake it)."""


@dataclass
class Scheduler:
    block_manager: BlockManager
    max_num_batched_tokens: int
    max_num_seqs: int
    num_preemptions: int = 0
    _waiting: list[ForwardRequest] = field(default_factory=list, init=False, repr=False)

    # ---- the queue ----------------------------------------------------------------------------------------------
    def enqueue(self, request: ForwardRequest) -> None:
        """Queue `request`; EngineError INVALID_ARGUMENT when its logits tokens can never fit one forward."""
        num_logits = request.num_logits
        if not len(request.extra_ids) < num_logits:
            raise ValueError(f"num_logits={num_logits} must exceed the {len(request.extra_ids)} extra tokens")
        self.check_fits(num_logits)
        if any(r.seq is request.seq for r in self._waiting):
            raise ValueError(f"seq {request.seq.seq_id} already has queued work")
        self._waiting.append(request)

    def check_fits(self, num_logits: int) -> None:
        """EngineError INVALID_ARGUMENT when `num_logits` tokens (the pending token and the drafts) can never run in
        one forward."""
        if num_logits > self.max_num_batched_tokens:
            raise EngineError("INVALID_ARGUMENT", f"{num_logits} tokens need logits in one forward (the pending "
                              f"token and {num_logits - 1} drafts), more than max_num_batched_tokens="
                              f"{self.max_num_batched_tokens}: send at most {self.max_num_batched_tokens - 1} drafts")

    def remove(self, request: ForwardRequest) -> bool:
        """Take `request` out of the queue (False if it was not queued)."""
        for i, queued in enumerate(self._waiting):
            if queued is request:
                del self._waiting[i]
                return True
        return False

    def cancel(self, seq: SeqState) -> list[ForwardRequest]:
        """Take every queued request of `seq` out of the queue and return them (the caller answers them)."""
        removed = [r for r in self._waiting if r.seq is seq]
        self._waiting = [r for r in self._waiting if r.seq is not seq]
        return removed

    def release(self, seq: SeqState) -> list[ForwardRequest]:
        """The sequence is done: cancel its queued requests (returned) and free its blocks."""
        removed = self.cancel(seq)
        self.reset(seq)
        return removed

    def clear(self) -> list[ForwardRequest]:
        """Empty the queue; returns what was in it."""
        removed, self._waiting = self._waiting, []
        return removed

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting(self) -> tuple[ForwardRequest, ...]:
        """A read-only snapshot of the queue, in order."""
        return tuple(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[ForwardRequest]:
        return iter(tuple(self._waiting))

    # ---- one step -----------------------------------------------------------------------------------------------
    def schedule(self, idle_seqs: Callable[[], Iterable[SeqState]]) -> tuple[list[ScheduledItem], list[Failure]]:
        """Returns (items for this forward, requests that must fail: expired, larger than the whole pool, faulty).

        Failed requests are already out of the queue."""
        budget = self.max_num_batched_tokens
        batch: list[ScheduledItem] = []
        failed = self._drop_expired()
        for req in list(self._waiting):
            if budget <= 0 or len(batch) >= self.max_num_seqs:
                break
            try:
                item = self._schedule_one(req, budget, batch, idle_seqs)
            except _Blocked:
                break
            except Exception as exc:     # one request's fault stays with that request
                failed.append((req, self._fault(req, exc)))
                continue
            if item is None:
                continue
            batch.append(item)
            budget -= len(item.token_ids)
            if item.is_final:
                self.remove(req)
        return batch, failed

    def _schedule_one(self, req: ForwardRequest, budget: int, batch: list[ScheduledItem],
                      idle_seqs: Callable[[], Iterable[SeqState]]) -> ScheduledItem | None:
        """The item `req` runs this step, None to skip it this step (its logits tokens need more room than is left);
        raises _Blocked when there is no KV room for it."""
        seq = req.seq
        if not seq.allocated:
            seq.num_computed = self.block_manager.allocate(seq.seq_id, seq.token_ids[: seq.num_verified])
            seq.num_cached_tokens = seq.num_computed
            seq.allocated = True
        self._align_kv(seq)
        start = seq.num_computed
        num_pending = len(seq.token_ids) - start + len(req.extra_ids)
        if num_pending < req.num_logits:
            raise EngineError("INTERNAL", f"seq {seq.seq_id} has {num_pending} tokens to run, fewer than the "
                              f"{req.num_logits} that need logits")
        if num_pending <= budget:
            run_ids, is_final = seq.token_ids[start:] + req.extra_ids, True
        else:
            num_chunk = min(budget, num_pending - req.num_logits)   # a chunk stops before the logits tokens
            if num_chunk <= 0:
                return None
            run_ids, is_final = seq.token_ids[start: start + num_chunk], False
        if not self._reserve(req, len(run_ids), batch, idle_seqs):
            if not batch and self._holds_only_itself(req):
                raise EngineError("RESOURCE_EXHAUSTED", "the sequence does not fit in the KV cache")
            raise _Blocked
        return ScheduledItem(req, start, run_ids, is_final)

    def _align_kv(self, seq: SeqState) -> None:
        """The block manager holds exactly num_computed tokens (a failed forward may have left reserved slots)."""
        held = self.block_manager.num_tokens(seq.seq_id)
        if held > seq.num_computed:
            self.block_manager.truncate(seq.seq_id, seq.num_computed)
        elif held < seq.num_computed:
            raise EngineError("INTERNAL", f"seq {seq.seq_id} claims {seq.num_computed} computed tokens, "
                              f"KV holds {held}")

    def _fault(self, req: ForwardRequest, exc: Exception) -> EngineError:
        self.remove(req)
        self.reset(req.seq)
        if isinstance(exc, EngineError) and exc.code != "INTERNAL":
            return exc
        log.error("scheduling seq %d failed", req.seq.seq_id, exc_info=exc)
        return exc if isinstance(exc, EngineError) else EngineError("INTERNAL", f"scheduling failed: {exc!r}")

    def _drop_expired(self) -> list[Failure]:
        now = time.monotonic()
        expired = [r for r in self._waiting if r.deadline is not None and now > r.deadline]
        for req in expired:
            self.remove(req)
        return [(r, EngineError("DEADLINE_EXCEEDED", "the request's deadline passed while it waited")) for r in expired]

    def _reserve(self, req: ForwardRequest, num_tokens: int, batch: list[ScheduledItem],
                 idle_seqs: Callable[[], Iterable[SeqState]]) -> bool:
        bm = self.block_manager
        seq_id = req.seq.seq_id
        if bm.can_append(seq_id, num_tokens):
            bm.append(seq_id, num_tokens)
            return True
        for victim in self._victims(req, batch, idle_seqs):
            if victim.allocated:
                self.preempt(victim)
            if bm.can_append(seq_id, num_tokens):
                bm.append(seq_id, num_tokens)
                return True
        return False

    def _victims(self, req: ForwardRequest, batch: list[ScheduledItem],
                 idle_seqs: Callable[[], Iterable[SeqState]]) -> list[SeqState]:
        """Idle sequences, then the sequences of requests queued after `req`, newest first."""
        protected = {item.request.seq.seq_id for item in batch} | {req.seq.seq_id}
        queued = {r.seq.seq_id for r in self._waiting}
        newer = self._waiting[self._waiting.index(req) + 1:]
        victims = [s for s in idle_seqs() if s.seq_id not in queued]
        victims += [r.seq for r in reversed(newer)]
        return [s for s in victims if s.allocated and s.seq_id not in protected]

    def _holds_only_itself(self, req: ForwardRequest) -> bool:
        """True when nothing else holds blocks, so waiting cannot help: the request is larger than the pool."""
        return self.block_manager.num_used_blocks == len(self.block_manager.block_table(req.seq.seq_id))

    # ---- sequences ----------------------------------------------------------------------------------------------
    def preempt(self, seq: SeqState) -> None:
        self.reset(seq)
        self.num_preemptions += 1

    def reset(self, seq: SeqState) -> None:
        """Free the sequence's blocks; its tokens are recomputed (mostly from the prefix cache) when it runs next."""
        if seq.allocated:
            self.block_manager.free(seq.seq_id)
        seq.allocated = False
        seq.num_computed = 0

    def commit(self, seq: SeqState) -> None:
        """After a forward: drop KV slots past num_computed (rejected drafts) and hash verified full blocks."""
        self.block_manager.truncate(seq.seq_id, seq.num_computed)
        self.block_manager.mark_verified(seq.seq_id, seq.token_ids[: min(seq.num_verified, seq.num_computed)])
