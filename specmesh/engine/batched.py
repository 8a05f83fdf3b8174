"""The engine step shared by the verifier and the draft service: schedule -> forward -> postprocess.

A fault stays inside its request: a request that fails to schedule or to finish is failed alone (its KV freed) and
the step goes on; a crash of the forward itself fails only the requests in that batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from opentelemetry.trace import SpanContext

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.loop import EngineError, EngineThread
from specmesh.engine.model_runner import ForwardItem, ModelRunner
from specmesh.engine.scheduler import ForwardRequest, ScheduledItem, Scheduler, SeqState
from specmesh.telemetry.engine_step import forward_span
from specmesh.telemetry.metrics import EngineMetrics

log = logging.getLogger(__name__)


class BatchedEngine(EngineThread):
    """Subclasses say which sequences are idle (preemptible) and what to do with each finished request's logits."""

    sessions: dict[str, Any]     # set by subclasses
    trace_steps = True           # a span per forward (metrics are always kept)

    def __init__(self, name: str, runner: ModelRunner, block_manager: BlockManager, max_num_batched_tokens: int,
                 max_num_seqs: int, num_threads: int) -> None:
        super().__init__(name, num_threads)
        self.runner = runner
        self.block_manager = block_manager
        self.scheduler = Scheduler(block_manager, max_num_batched_tokens, max_num_seqs)
        self.num_steps = 0
        self.num_batch_tokens = 0      # tokens in the forward being finished (every sequence in the batch)
        self.metrics = EngineMetrics()
        self.metrics.watch(lambda: self.scheduler.num_waiting, lambda: len(self.sessions),
                           lambda: block_manager.num_used_blocks, lambda: block_manager.num_free_blocks)

    def has_work(self) -> bool:
        return self.scheduler.num_waiting > 0

    def idle_seqs(self) -> Iterable[SeqState]:
        raise NotImplementedError

    def finish(self, request: ForwardRequest, logits: torch.Tensor) -> None:
        """logits [num_logits, V] of a request whose tokens all ran."""
        raise NotImplementedError

    def fail(self, request: ForwardRequest, exc: EngineError) -> None:
        raise NotImplementedError

    def span_context(self, request: ForwardRequest) -> SpanContext | None:
        """The span of the caller that submitted the request: the forward's span links to it."""
        return None

    def step(self) -> None:
        batch, failed = self.scheduler.schedule(self.idle_seqs)
        for request, error in failed:
            self._fail_one(request, error)
        batch, items = self._forward_items(batch)
        if not batch:
            return
        self.num_batch_tokens = sum(len(item.token_ids) for item in items)
        links = [self.span_context(i.request) for i in batch] if self.trace_steps else None
        try:
            with forward_span(self._name, self.metrics, batch, links):
                all_logits = self.runner.forward(items)
        except Exception as exc:       # the forward crashed: fail its batch, not the requests still queued
            log.exception("%s forward failed", self._name)
            for item in batch:
                self._fail_unexpected(item.request, EngineError("INTERNAL", f"engine forward failed: {exc!r}"))
            return
        self.num_steps += 1
        for item, logits in zip(batch, all_logits, strict=True):
            try:
                if item.is_final:
                    self.finish(item.request, logits)
                else:
                    item.request.seq.num_computed += len(item.token_ids)
            except Exception as exc:
                log.exception("%s finishing seq %d failed", self._name, item.request.seq.seq_id)
                self._fail_unexpected(item.request, exc)

    def _forward_items(self, batch: list[ScheduledItem]) -> tuple[list[ScheduledItem], list[ForwardItem]]:
        kept: list[ScheduledItem] = []
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

    def _fail_unexpected(self, request: ForwardRequest, exc: BaseException) -> None:
        """Fail one request after a fault in its processing; its KV is dropped (recomputed if its sequence goes on)."""
        error = exc if isinstance(exc, EngineError) else EngineError("INTERNAL", f"engine step failed: {exc!r}")
        self.scheduler.remove(request)
        self.scheduler.reset(request.seq)
        self._fail_one(request, error)

    def _fail_one(self, request: ForwardRequest, error: EngineError) -> None:
        try:
            self.fail(request, error)
        except Exception:
            log.exception("%s failing seq %d raised", self._name, request.seq.seq_id)

    def _forward_item(self, item: ScheduledItem) -> ForwardItem:
        end = item.start_pos + len(item.token_ids)
        kv_slots = self.block_manager.slot_mapping(item.request.seq.seq_id, 0, end)
        return ForwardItem(item.token_ids, item.start_pos, kv_slots, item.request.num_logits if item.is_final else 0)

    def fail_all(self, exc: BaseException) -> None:
        """Last resort after step() itself crashed: fail every queued request."""
        error = exc if isinstance(exc, EngineError) else EngineError("INTERNAL", str(exc))
        for request in self.scheduler.clear():
            self._fail_one(request, error)
