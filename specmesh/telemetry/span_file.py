"""A SpanExporter writing one JSON object per span to a local file, so traces need no collector to inspect.

Several processes may share one file: each export is a single `write()` to a file opened with O_APPEND.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import format_span_id, format_trace_id


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None
    attributes = span.attributes or {}
    return {
        "trace_id": format_trace_id(ctx.trace_id),
        "span_id": format_span_id(ctx.span_id),
        "parent_span_id": format_span_id(span.parent.span_id) if span.parent else None,
        "name": span.name,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items()},
        "links": [{"trace_id": format_trace_id(link.context.trace_id),
                   "span_id": format_span_id(link.context.span_id)} for link in span.links],
        "status": {"code": span.status.status_code.name, "description": span.status.description or ""},
        "events": [{"name": e.name, "time_ns": e.timestamp} for e in span.events],
        "service.name": span.resource.attributes.get("service.name", ""),
    }


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = path
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            while data:
                data = data[os.write(self._fd, data):]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
