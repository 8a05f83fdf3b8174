"""Continuous-batching scheduler on plain ints: which sequences run how many tokens in the next forward.

Every piece of pending work is a `ForwardRequest` (scheduled.py): run the sequence's uncomputed context tokens plus
some extra tokens (draft tokens to verify), and return logits for the last `num_logits` of them (the "logits
tokens": the pending token and the drafts). The scheduler owns its queue: engines `enqueue`, `remove`, `cancel` and
`release`; nothing else edits it.

Rules (all tested in tests/test_scheduler.py without torch):

* Work of sequences that are already decoding comes first: a "decode" request is one whose uncomputed context is
  at most one block (the pending token, or what a preemption left beyond the prefix cache), so it runs whole in
  one forward (verifies, decoding ahead, a short prompt); a request that ran a chunk stays prefill until only its
  logits tokens are left. Decodes are scheduled in arrival order, then
  prefill requests (the rest) in arrival order fill what is left of the step, then decodes that were deferred.
* A step is sized in time as well as tokens (`StepBudget`, step_budget.py): with the engine's measured cost t(n, P)
  of n tokens with P attention pairs, a step carrying d decode tokens (or run while a stream is between two
  requests) costs at most max(factor * t(max(d, 1), P_d), t(d + min_prefill_tokens, P_d + the reserve's pairs)).
  While prefill waits, decodes leave it one of the `max_num_seqs` slots and min(min_prefill_tokens,
  max_num_batched_tokens // 2) tokens (unless the oldest request of all is a decode), so a long prompt progresses
  every step and a decode waits at most one step per older decode (one that does not fit beside that reserve waits
  until the prefill is done or it is the oldest).
* Within `max_num_batched_tokens` a request whose tokens do not fit what is left is chunked: a chunk runs only
  context tokens and always stops before the logits tokens, so the final item of a request runs all of them in one
  forward. A request whose logits tokens alone exceed the budget is refused at `enqueue`.
* At most one queued request per sequence.
* When blocks run out, idle sequences (no queued work) are preempted first, then the newest waiting ones (only ones
  queued after the request that needs the room); a preempted sequence frees its blocks and recomputes later (its
  verified full blocks usually come back from the prefix cache). A request without KV room is not overtaken by
  newer ones in that step; when the oldest request of all is a prefill that found no room, the next step is served
  in plain arrival order, so it may take the room of newer decodes (KV is granted by age).
* A fault while scheduling one request (an EngineError, or any bug) fails that request only: it leaves the queue,
  its sequence's KV is freed, and the other requests are scheduled as usual.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.errors import EngineError
from specmesh.engine.scheduled import R, ScheduledItem, SeqState, StepStats
from specmesh.engine.step_budget import StepBudget

log = logging.getLogger(__name__)

Failure = tuple[R, EngineError]


class _Blocked(Exception):
    """No KV room for this request now: stop scheduling this step (later requests must not overtake it)."""


@dataclass
class _Plan(Generic[R]):
    """One step being filled: the batch, the tokens still free, and how far in the queue it may go."""
    queue: list[R]
    tokens_left: int
    batch: list[ScheduledItem[R]] = field(default_factory=list)
    done: set[int] = field(default_factory=set)          # id() of requests scheduled or failed this step
    stop: int | None = None                              # queue index of a request blocked for KV room
    num_pairs: int = 0                                   # attention pairs of the batch so far
    failed: list[Failure[R]] = field(default_factory=list)

    def add(self, item: ScheduledItem[R]) -> None:
        self.batch.append(item)
        self.tokens_left -= len(item.token_ids)
        self.num_pairs += item.num_pairs
        self.done.add(id(item.request))

    def open(self, req: R) -> bool:
        """Not yet scheduled or failed this step, and not behind a blocked request."""
        return id(req) not in self.done and (self.stop is None or self.queue.index(req) < self.stop)

    def tokens(self, decode: bool) -> int:
        return sum(len(i.token_ids) for i in self.batch if i.is_decode == decode)

    def pairs(self, decode: bool) -> int:
        return sum(i.num_pairs for i in self.batch if i.is_decode == decode)


@dataclass
class Scheduler(Generic[R]):
    block_manager: BlockManager
    max_num_batched_tokens: int
    max_num_seqs: int
    step_budget: StepBudget = field(default_factory=StepBudget)
    # A decode's uncomputed context may be up to this many tokens (0: one KV block). The draft service raises it: a
    # running session's Propose brings every token verified since its last one (rounds the gateway drafted from
    # elsewhere), and behind a long prompt's chunks that catch-up would wait out the whole prefill.
    max_decode_tokens: int = 0
    num_preemptions: int = 0
    last_step: StepStats = field(default_factory=StepStats, init=False)
    _waiting: list[R] = field(default_factory=list, init=False, repr=False)
    _oldest_blocked: bool = field(default=False, init=False, repr=False)   # serve the next step in arrival order

    # ---- the queue ----------------------------------------------------------------------------------------------
    def enqueue(self, request: R) -> None:
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

    def remove(self, request: R) -> bool:
        """Take `request` out of the queue (False if it was not queued)."""
        for i, queued in enumerate(self._waiting):
            if queued is request:
                del self._waiting[i]
                return True
        return False

    def cancel(self, seq: SeqState) -> list[R]:
        """Take every queued request of `seq` out of the queue and return them (the caller answers them)."""
        removed = [r for r in self._waiting if r.seq is seq]
        self._waiting = [r for r in self._waiting if r.seq is not seq]
        return removed

    def release(self, seq: SeqState) -> list[R]:
        """The sequence is done: cancel its queued requests (returned) and free its blocks."""
        removed = self.cancel(seq)
        self.reset(seq)
        return removed

    def clear(self) -> list[R]:
        """Empty the queue; returns what was in it."""
        removed, self._waiting = self._waiting, []
        return removed

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting(self) -> tuple[R, ...]:
        """A read-only snapshot of the queue, in order."""
        return tuple(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[R]:
        return iter(tuple(self._waiting))

    # ---- one step -----------------------------------------------------------------------------------------------
    def is_decode(self, req: R) -> bool:
        """Work of a sequence that is already decoding: its uncomputed context (the pending token, tokens verified
        since the last call, or what a preemption left beyond the prefix cache) is at most one block
        (`max_decode_tokens` where set), so it runs whole in one forward. A request chunked before stays prefill
        until only its logits tokens are left: a long prompt's last block, late in its context and so dear, is sized
        by the step budget like its other chunks instead of running whole before the streams' work."""
        seq = req.seq
        num_pending = len(seq.token_ids) - seq.num_computed
        if req.chunked:
            return seq.allocated and num_pending <= req.num_logits - len(req.extra_ids)
        return seq.allocated and num_pending <= (self.max_decode_tokens or self.block_manager.block_size)

    def schedule(self, idle_seqs: Callable[[], Iterable[SeqState]]) -> tuple[list[ScheduledItem[R]], list[Failure[R]]]:
        """Returns (items for this forward, requests that must fail: expired, larger than the whole pool, faulty).

        Failed requests are already out of the queue."""
        failed = self._drop_expired()
        for req in list(self._waiting):
            try:
                self._prepare(req)
            except Exception as exc:     # one request's fault stays with that request
                failed.append((req, self._fault(req, exc)))
        plan = _Plan(list(self._waiting), self.max_num_batched_tokens, failed=failed)
        decodes = [r for r in plan.queue if self.is_decode(r)]
        prefills = [r for r in plan.queue if not self.is_decode(r)]
        streams = bool(decodes) or self._streams_waiting(idle_seqs)      # a decode waits or may come any time
        in_order = bool(prefills) and (self._oldest_blocked or self.max_num_seqs == 1 and plan.queue[0] is prefills[0])
        if in_order:                     # KV by age (or one slot): oldest first, every item within the bound
            bound = self.step_budget.bound(0, streams, 0, self._last_floor_pos(plan.queue[0]))
            self._fill(plan, plan.queue, bound, idle_seqs)
        else:
            self._fill_decodes(plan, decodes, prefills, idle_seqs)
            bound = self.step_budget.bound(plan.tokens(decode=True), streams, plan.pairs(decode=True),
                                           self._last_floor_pos(prefills[0]) if prefills else 0)
            self._fill(plan, prefills, bound, idle_seqs)
            self._fill(plan, decodes, bound, idle_seqs)       # decodes deferred by the prefill's reserve
        self._oldest_blocked = bool(prefills) and plan.stop == plan.queue.index(prefills[0])
        num_tokens = self.max_num_batched_tokens - plan.tokens_left
        estimated = self.step_budget.seconds(num_tokens, plan.num_pairs) if bound is not None and num_tokens else None
        self.last_step = StepStats(plan.tokens(decode=True), plan.tokens(decode=False), bound,
                                   plan.stop is not None, in_order, estimated)
        return plan.batch, plan.failed

    def _last_floor_pos(self, req: R) -> int:
        """Where the last min_prefill_tokens of `req`'s uncomputed tokens start. The step that carries them beside
        the decodes is the dearest of its prefill (its attention spans the whole prompt), and with it the stream's
        longest gap; the bound lets every earlier step cost as much, so their prompt tokens (cheaper: less to
        attend to) fill that time instead of stopping at factor x the decodes alone."""
        end = len(req.seq.token_ids) + len(req.extra_ids)
        return max(req.seq.num_computed, end - self.step_budget.min_prefill_tokens)

    def _fill_decodes(self, plan: _Plan[R], decodes: list[R], prefills: list[R],
                      idle_seqs: Callable[[], Iterable[SeqState]]) -> None:
        """Decodes first, in arrival order; while prefill waits they leave it a slot and min_prefill_tokens (at most
        half the token budget; the oldest request of all, if a decode, takes what it needs)."""
        reserve_seqs = 1 if prefills and self.max_num_seqs > 1 else 0
        reserve = min(self.step_budget.min_prefill_tokens, self.max_num_batched_tokens // 2) if prefills else 0
        for req in decodes:
            if len(plan.batch) >= self.max_num_seqs - reserve_seqs:
                return
            room = plan.tokens_left if req is plan.queue[0] else plan.tokens_left - reserve
            if room > 0 and req.seq.allocated and not self._place(plan, req, room, idle_seqs):
                return

    def _fill(self, plan: _Plan[R], requests: list[R], bound: float | None,
              idle_seqs: Callable[[], Iterable[SeqState]]) -> None:
        """Requests in order, each within the tokens left and the step's time bound."""
        for req in requests:
            if plan.tokens_left <= 0 or len(plan.batch) >= self.max_num_seqs:
                return
            if not plan.open(req):
                continue
            num_tokens = self.max_num_batched_tokens - plan.tokens_left
            room = self.step_budget.room(num_tokens, bound, plan.tokens_left, plan.num_pairs, req.seq.num_computed)
            if room > 0 and not self._place(plan, req, room, idle_seqs):
                return

    def _place(self, plan: _Plan[R], req: R, room: int,
               idle_seqs: Callable[[], Iterable[SeqState]]) -> bool:
        """Schedule what of `req` fits `room` tokens; False when it is blocked for KV room (the step stops)."""
        try:
            item = self._schedule_one(req, room, plan.batch, idle_seqs)
        except _Blocked:
            plan.stop = plan.queue.index(req)
            return False
        except Exception as exc:         # one request's fault stays with that request
            plan.failed.append((req, self._fault(req, exc)))
            plan.done.add(id(req))
            return True
        if item is not None:
            plan.add(item)
            if item.is_final:
                self.remove(req)
        return True

    def _streams_waiting(self, idle_seqs: Callable[[], Iterable[SeqState]]) -> bool:
        """A sequence holding KV with no work queued: a stream between two requests (its next may come any time)."""
        queued = {r.seq.seq_id for r in self._waiting}
        return any(s.allocated and s.seq_id not in queued for s in idle_seqs())

    def _prepare(self, req: R) -> None:
        """Allocate the sequence (prefix cache) and check its KV and its tokens."""
        seq = req.seq
        if not seq.allocated:
            seq.num_computed = self.block_manager.allocate(seq.seq_id, seq.token_ids[: seq.num_verified])
            seq.num_cached_tokens = seq.num_computed
            seq.allocated = True
        self._align_kv(seq)
        num_pending = len(seq.token_ids) - seq.num_computed + len(req.extra_ids)
        if num_pending < req.num_logits:
            raise EngineError("INTERNAL", f"seq {seq.seq_id} has {num_pending} tokens to run, fewer than the "
                              f"{req.num_logits} that need logits")

    def _schedule_one(self, req: R, budget: int, batch: list[ScheduledItem[R]],
                      idle_seqs: Callable[[], Iterable[SeqState]]) -> ScheduledItem[R] | None:
        """The item `req` runs this step, None to skip it this step (its logits tokens need more room than is left);
        raises _Blocked when there is no KV room for it."""
        if not req.seq.allocated:        # a preemption earlier in this step freed its KV: recompute
            self._prepare(req)
        seq = req.seq
        start = seq.num_computed
        num_pending = len(seq.token_ids) - start + len(req.extra_ids)
        decode = self.is_decode(req)
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
        if not is_final and not decode:              # a decode split by a full step stays a decode
            req.chunked = True
        return ScheduledItem(req, start, run_ids, is_final, decode)

    def _align_kv(self, seq: SeqState) -> None:
        """The block manager holds exactly num_computed tokens (a failed forward may have left reserved slots)."""
        held = self.block_manager.num_tokens(seq.seq_id)
        if held > seq.num_computed:
            self.block_manager.truncate(seq.seq_id, seq.num_computed)
        elif held < seq.num_computed:
            raise EngineError("INTERNAL", f"seq {seq.seq_id} claims {seq.num_computed} computed tokens, "
                              f"KV holds {held}")

    def _fault(self, req: R, exc: Exception) -> EngineError:
        self.remove(req)
        self.reset(req.seq)
        if isinstance(exc, EngineError) and exc.code != "INTERNAL":
            return exc
        log.error("scheduling seq %d failed", req.seq.seq_id, exc_info=exc)
        return exc if isinstance(exc, EngineError) else EngineError("INTERNAL", f"scheduling failed: {exc!r}")

    def _drop_expired(self) -> list[Failure[R]]:
        now = time.monotonic()
        expired = [r for r in self._waiting if r.deadline is not None and now > r.deadline]
        for req in expired:
            self.remove(req)
        return [(r, EngineError("DEADLINE_EXCEEDED", "the request's deadline passed while it waited")) for r in expired]

    def _reserve(self, req: R, num_tokens: int, batch: list[ScheduledItem[R]],
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

    def _victims(self, req: R, batch: list[ScheduledItem[R]],
                 idle_seqs: Callable[[], Iterable[SeqState]]) -> list[SeqState]:
        """Idle sequences, then the sequences of requests queued after `req`, newest first."""
        protected = {item.request.seq.seq_id for item in batch} | {req.seq.seq_id}
        queued = {r.seq.seq_id for r in self._waiting}
        newer = self._waiting[self._waiting.index(req) + 1:]
        victims = [s for s in idle_seqs() if s.seq_id not in queued]
        victims += [r.seq for r in reversed(newer)]
        return [s for s in victims if s.allocated and s.seq_id not in protected]

    def _holds_only_itself(self, req: R) -> bool:
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
