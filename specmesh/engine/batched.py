"""The engine step shared by the verifier and the draft service: schedule -> forward -> postprocess.

A fault stays inside its request: a request that fails to schedule or to finish is failed alone (its KV freed) and
the step goes on; a crash of the forward itself fails only the requests in that batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic

import torch
from opentelemetry.trace import SpanContext

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.errors import ForwardInterrupted
from specmesh.engine.forward_cost import ForwardCost
from specmesh.engine.loop import EngineError, EngineThread
from specmesh.engine.model_runner import ForwardItem, ModelRunner
from specmesh.engine.prefill_wait import PrefillClock
from specmesh.engine.scheduled import ForwardRequest, R, ScheduledItem, SeqState, batch_composition, num_context_tokens
from specmesh.engine.scheduler import Scheduler
from specmesh.engine.step_budget import StepBudget, check_step_budget
from specmesh.engine.step_cost import StepCost
from specmesh.telemetry.engine_step import forward_span
from specmesh.telemetry.metrics import EngineMetrics

log = logging.getLogger(__name__)


class BatchedEngine(EngineThread, Generic[R]):
    """Subclasses say which sequences are idle (preemptible) and what to do with each finished request's logits;
    R is their request type (a ForwardRequest carrying what they need to answer it)."""

    sessions: dict[str, Any]     # set by subclasses
    trace_steps = True           # a span per forward (metrics are always kept)

    def __init__(self, name: str, runner: ModelRunner, block_manager: BlockManager, max_num_batched_tokens: int,
                 max_num_seqs: int, num_threads: int, max_decode_tokens: int = 0) -> None:
        super().__init__(name, num_threads)
        self.runner = runner
        self.block_manager = block_manager
        # seconds of a step by its size (every forward), which sizes the steps that carry prefill (step_budget.py)
        self.step_cost = StepCost()
        self.scheduler: Scheduler[R] = Scheduler(block_manager, max_num_batched_tokens, max_num_seqs,
                                                 StepBudget(self.step_seconds, pair_cost=self.pair_seconds),
                                                 max_decode_tokens)
        self.prefill_clock = PrefillClock()       # when forwards carrying prefill ran (waits behind prefill)
        self.num_steps = 0
        self.num_threads = num_threads
        # the last completed forward: seconds, threads, whether it computed a prompt's (or context's) KV
        self.forward_s, self.forward_threads, self.forward_prefills = 0.0, num_threads, False
        self.num_threads_max = num_threads     # see set_thread_policy
        self.max_threads_min_tokens = 0
        self.num_batch_tokens = 0      # tokens in the forward being finished (every sequence in the batch)
        # what one more token costs a forward, measured on decode- and verify-sized forwards (no prompt KV computed)
        self.forward_cost = ForwardCost()
        self.metrics = EngineMetrics()
        self._logits = torch.empty(0, 0)           # the current step's logits, rows of finished requests
        self._rows: dict[int, int] = {}           # id(request) -> its first row in _logits
        self._argmax: list[int] | None = None     # argmax of every row of _logits, computed on first use
        self.metrics.watch(lambda: self.scheduler.num_waiting, lambda: len(self.sessions),
                           lambda: block_manager.num_used_blocks, lambda: block_manager.num_free_blocks)

    def set_thread_policy(self, num_threads_max: int, min_tokens: int) -> None:
        """Steps of at least `min_tokens` tokens run on `num_threads_max` torch threads (0 or less than num_threads:
        off). For a verifier sharing its host with a draft service that idles while it verifies: min_tokens 1."""
        self.num_threads_max = max(self.num_threads, num_threads_max)
        self.max_threads_min_tokens = max(1, min_tokens)

    def set_step_budget(self, factor: float, min_prefill_tokens: int) -> None:
        """A step carrying decodes costs at most `factor` times its decodes alone, and always fits
        `min_prefill_tokens` of prefill (step_budget.py); factor 0: token budget only."""
        check_step_budget(factor, min_prefill_tokens)
        self.scheduler.step_budget = StepBudget(self.step_seconds if factor else None, factor, min_prefill_tokens,
                                                self.pair_seconds)

    def step_seconds(self, num_tokens: int) -> float | None:
        """Measured seconds of a step of `num_tokens` tokens under the engine's thread policy (None: not yet)."""
        return self.step_cost.seconds(num_tokens, BatchedEngine.threads_for(self, num_tokens))

    def pair_seconds(self, num_tokens: int) -> float:
        """Measured seconds one attention pair adds to a step of `num_tokens` tokens (its thread count's)."""
        return self.step_cost.pair_seconds(BatchedEngine.threads_for(self, num_tokens))

    def threads_for(self, num_tokens: int) -> int:
        if self.num_threads_max > self.num_threads and num_tokens >= self.max_threads_min_tokens:
            return self.num_threads_max
        return self.num_threads

    def has_work(self) -> bool:
        return self.scheduler.num_waiting > 0

    def idle_seqs(self) -> Iterable[SeqState]:
        raise NotImplementedError

    def finish(self, request: R, logits: torch.Tensor) -> None:
        """logits [num_logits, V] of a request whose tokens all ran."""
        raise NotImplementedError

    def fail(self, request: R, exc: EngineError) -> None:
        raise NotImplementedError

    def interrupt_check(self, batch: list[ScheduledItem[R]]) -> Callable[[], bool] | None:
        """A check the forward of `batch` asks between layers: True abandons it (see `interrupted`). None: never."""
        return None

    def interrupted(self, request: R) -> None:
        """A request whose forward was abandoned: out of the queue already, its KV as before the forward (the
        scheduler drops the slots it reserved when the sequence runs next)."""
        raise NotImplementedError

    def span_context(self, request: R) -> SpanContext | None:
        """The span of the caller that submitted the request: the forward's span links to it."""
        return None

    def submitted_at(self, request: R) -> float | None:
        """time.monotonic() when a waiting caller submitted the request (None: nobody waits for it)."""
        return None

    def step(self) -> None:
        batch, failed = self.scheduler.schedule(self.idle_seqs)
        for request, error in failed:
            self._fail_one(request, error)
        batch, items = self._forward_items(batch)
        if not batch:
            return
        self.num_batch_tokens = sum(len(item.token_ids) for item in items)
        num_pairs = sum(item.num_pairs for item in batch)
        links = [self.span_context(i.request) for i in batch] if self.trace_steps else None
        threads = self.threads_for(self.num_batch_tokens)
        if threads != torch.get_num_threads():       # the engine thread's own setting (int8 logits do not change)
            torch.set_num_threads(threads)
        self.runner.interrupt = self.interrupt_check(batch)
        step_attributes = self._step_attributes(batch) | {"specmesh.step.num_threads": threads}
        try:
            started, wall_start = time.perf_counter(), time.monotonic()
            with forward_span(self._name, self.metrics, batch_composition(batch), links, step_attributes):
                logits = self.runner.forward_flat(items)
            self.forward_s, self.forward_threads = time.perf_counter() - started, threads
            if not all(item.is_decode for item in batch):
                self.prefill_clock.record(wall_start, time.monotonic())
            self.forward_prefills = any(num_context_tokens(i) > 1 for i in batch)
        except ForwardInterrupted:     # gave way to more urgent work: as if it never ran
            for item in batch:
                self.interrupted(item.request)
            return
        except Exception as exc:       # the forward crashed: fail its batch, not the requests still queued
            log.exception("%s forward failed", self._name)
            for item in batch:
                self._fail_unexpected(item.request, EngineError("INTERNAL", f"engine forward failed: {exc!r}"))
            return
        self.num_steps += 1
        self.step_cost.observe(self.num_batch_tokens, threads, self.forward_s, num_pairs)
        if not self.forward_prefills:
            self.forward_cost.observe(self.num_batch_tokens, threads, self.forward_s)
        finished: list[R] = []
        for item in batch:
            if item.is_final:
                finished.append(item.request)
            else:
                item.request.seq.num_computed += len(item.token_ids)
        self._argmax = None
        self._rows = {id(r): n for r, n in zip(finished, self._row_offsets(finished), strict=True)}
        self._logits = logits
        self.finish_batch(finished, logits)

    def _step_attributes(self, batch: list[ScheduledItem[R]]) -> dict[str, float]:
        """Observes each decode request's wait behind prefill; the step span's scheduling attributes."""
        now, longest = time.monotonic(), 0.0
        for item in batch:
            submitted = self.submitted_at(item.request) if item.is_decode and item.is_final else None
            if submitted is not None:
                waited = self.prefill_clock.waited(submitted, now)
                self.metrics.prefill_wait.observe(waited)
                longest = max(longest, waited)
        bound = self.scheduler.last_step.bound_s
        attributes = {"specmesh.step.max_prefill_wait_s": longest}
        if bound is not None:
            attributes["specmesh.step.time_bound_s"] = bound
        estimated = self.scheduler.last_step.estimated_s
        if estimated is not None:
            attributes["specmesh.step.estimated_s"] = estimated
        return attributes

    def finish_batch(self, requests: list[R], logits: torch.Tensor) -> None:
        """logits [sum of num_logits, V]: the finished requests' rows back to back, in order. By default each
        request is finished alone; a fault fails only its own request."""
        for request, rows in zip(requests, torch.split(logits, [r.num_logits for r in requests]), strict=True):
            try:
                self.finish(request, rows)
            except Exception as exc:
                log.exception("%s finishing seq %d failed", self._name, request.seq.seq_id)
                self._fail_unexpected(request, exc)

    def argmax_rows(self, request: R) -> list[int]:
        """The argmax of each of `request`'s logits rows in the current step (inside finish / finish_batch). The
        first call takes one argmax over every row of the forward [num_tokens, V]; later calls slice it."""
        if self._argmax is None:
            self._argmax = torch.argmax(self._logits, dim=-1).tolist() if self._logits.shape[0] else []
        start = self._rows[id(request)]
        return self._argmax[start:start + request.num_logits]

    @staticmethod
    def _row_offsets(requests: Sequence[ForwardRequest]) -> list[int]:
        offsets, start = [], 0
        for r in requests:
            offsets.append(start)
            start += r.num_logits
        return offsets

    def _forward_items(self, batch: list[ScheduledItem[R]]) -> tuple[list[ScheduledItem[R]], list[ForwardItem]]:
        kept: list[ScheduledItem[R]] = []
        items: list[ForwardItem] = []
        for item in batch:
            try:
                items.append(self._forward_item(item))
            except Exception as exc:
                log.exception("%s preparing seq %d failed", self._name, item.request.seq.seq_id)
                self._fail_unexpected(item.request, exc)
            else:
                kept.append(item)
        return kept, items

    def _fail_unexpected(self, request: R, exc: BaseException) -> None:
        """Fail one request after a fault in its processing; its KV is dropped (recomputed if its sequence goes on)."""
        error = exc if isinstance(exc, EngineError) else EngineError("INTERNAL", f"engine step failed: {exc!r}")
        self.scheduler.remove(request)
        self.scheduler.reset(request.seq)
        self._fail_one(request, error)

    def _fail_one(self, request: R, error: EngineError) -> None:
        try:
            self.fail(request, error)
        except Exception:
            log.exception("%s failing seq %d raised", self._name, request.seq.seq_id)

    def _forward_item(self, item: ScheduledItem[R]) -> ForwardItem:
        table = self.block_manager.block_table(item.request.seq.seq_id)
        return ForwardItem(item.token_ids, item.start_pos, table, item.request.num_logits if item.is_final else 0)

    def fail_all(self, exc: BaseException) -> None:
        """Last resort after step() itself crashed: fail every queued request."""
        error = exc if isinstance(exc, EngineError) else EngineError("INTERNAL", str(exc))
        for request in self.scheduler.clear():
            self._fail_one(request, error)
