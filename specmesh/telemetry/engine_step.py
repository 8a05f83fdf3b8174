"""The span and metrics of one batched engine forward.

The engine runs on its own thread and one forward serves many requests, so its span cannot be a child of all of
them: it starts its own trace and carries a LINK to the span of every request it served (the span that was
current when the request's work item was submitted, see `Completion.span_context`). The engine hands over plain
counts (`specmesh.engine.scheduled.batch_composition`): telemetry never imports the engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext

from specmesh.telemetry.cpu_wait import CpuWait
from specmesh.telemetry.metrics import EngineMetrics

_tracer = trace.get_tracer("specmesh.engine")
_cpu_wait = CpuWait()     # the calling engine thread's and the kernel workers' run-queue wait (cpu_wait.py)
_ROOT = trace.set_span_in_context(trace.INVALID_SPAN)


def _links(contexts: Iterable[SpanContext | None]) -> list[Link]:
    seen: set[int] = set()
    links = []
    for ctx in contexts:
        if ctx is not None and ctx.is_valid and ctx.span_id not in seen:
            seen.add(ctx.span_id)
            links.append(Link(ctx))
    return links


def batch_attributes(num_seqs: int, num_decode_tokens: int, num_prefill_tokens: int) -> dict[str, int]:
    """Sequences and tokens of a forward, and its composition as the scheduler put it: decode tokens (work of
    sequences already decoding) and prefill tokens (prompt or recomputed context chunks)."""
    return {"specmesh.batch.num_seqs": num_seqs, "specmesh.batch.num_tokens": num_decode_tokens + num_prefill_tokens,
            "specmesh.batch.num_decode_tokens": num_decode_tokens,
            "specmesh.batch.num_prefill_tokens": num_prefill_tokens}


@contextmanager
def forward_span(engine: str, metrics: EngineMetrics, composition: tuple[int, int, int],
                 links: Iterable[SpanContext | None] | None,
                 step_attributes: dict[str, float] | None = None) -> Iterator[None]:
    """Wraps one forward: a span named "<engine> forward" (unless links is None) and the batch metrics.
    composition: (sequences, decode tokens, prefill tokens) of the forward's batch.
    step_attributes: more attributes of the span (the scheduler's time bound, the longest wait behind prefill).
    The span also gets the seconds the compute threads waited for a core meanwhile (cpu_wait.py)."""
    start = time.perf_counter()
    attributes: dict[str, float] = {**batch_attributes(*composition), **(step_attributes or {})}
    waits = _cpu_wait.sample()
    if links is None:
        yield
        cpu_wait_s = CpuWait.seconds_since(waits, _cpu_wait.sample())
    else:
        with _tracer.start_as_current_span(f"{engine} forward", context=_ROOT, links=_links(links),
                                           attributes=attributes) as span:
            yield
            cpu_wait_s = CpuWait.seconds_since(waits, _cpu_wait.sample())
            if cpu_wait_s is not None:
                span.set_attribute("specmesh.step.cpu_wait_s", cpu_wait_s)
    if cpu_wait_s is not None:
        metrics.cpu_wait.inc(cpu_wait_s)
    metrics.forward_seconds.observe(time.perf_counter() - start)
    metrics.batch_size.observe(composition[0])
    metrics.batch_tokens.observe(attributes["specmesh.batch.num_tokens"])
    metrics.step_tokens.labels("decode").observe(attributes["specmesh.batch.num_decode_tokens"])
    metrics.step_tokens.labels("prefill").observe(attributes["specmesh.batch.num_prefill_tokens"])
