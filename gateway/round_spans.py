"""Spans of a generation's steps on the gateway: prefill, each draft -> verify round, ending the session.

Each is a child of the request span (`parent`, see RequestTelemetry.context) and current while its RPCs run, so
the client interceptors make every Propose / Verify / StartSession call a child of its round.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.context import Context

from gateway.proposers.base import Draft
from gateway.request_telemetry import draft_source_name

_tracer = trace.get_tracer("specmesh.gateway")


@contextmanager
def prefill_span(parent: Context | None, num_prompt_tokens: int) -> Iterator[trace.Span]:
    with _tracer.start_as_current_span("prefill", context=parent,
                                       attributes={"specmesh.prefill.prompt_tokens": num_prompt_tokens}) as span:
        yield span


@contextmanager
def round_span(parent: Context | None, index: int) -> Iterator[trace.Span]:
    with _tracer.start_as_current_span("round", context=parent, attributes={"specmesh.round.index": index}) as span:
        yield span


def record_round(span: trace.Span, draft: Draft, num_accepted: int) -> None:
    span.set_attributes({"specmesh.round.drafted": len(draft.token_ids), "specmesh.round.accepted": num_accepted,
                         "specmesh.round.draft_source": draft_source_name(draft.source)})


@contextmanager
def cache_lookup_span() -> Iterator[trace.Span]:
    """The draft cache hop (Redis or in-process), a child of the current round span."""
    with _tracer.start_as_current_span("cache_lookup") as span:
        yield span


@contextmanager
def end_session_span(parent: Context | None) -> Iterator[trace.Span]:
    with _tracer.start_as_current_span("end_session", context=parent) as span:
        yield span
