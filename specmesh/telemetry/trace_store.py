"""Reads spans back for inspection: from the JSON-lines span file or from Jaeger's HTTP query API.

Both give spans as dicts in the span file's format (see `span_file.span_to_dict`).
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

Span = dict[str, Any]


def load_file(path: str | Path) -> list[Span]:
    spans = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            spans.append(json.loads(line))
        except json.JSONDecodeError:
            continue                       # a line being written by another process
    return spans


def last_trace_id(spans: list[Span]) -> str:
    """The trace of the latest root span that is a request: a served RPC (SERVER kind) that began a trace. Not an
    engine forward (a root of its own, linking the requests it served, or none when it ran for no caller) and not a
    call a service made on its own (e.g. the gateway asking the verifier's model info: a CLIENT root)."""
    roots = [s for s in spans if not s.get("parent_span_id") and not s.get("links")]
    served = [s for s in roots if s.get("kind") == "SERVER"]
    requests = served or [s for s in roots if not s["name"].endswith(" forward")] or roots or spans
    if not requests:
        raise LookupError("no spans")
    return max(requests, key=lambda s: s["start_ns"])["trace_id"]


def select_trace(spans: list[Span], trace_id: str) -> tuple[list[Span], list[Span]]:
    """(the trace's spans, spans of other traces linking into it: the engine forwards that served it)."""
    own = [s for s in spans if s["trace_id"] == trace_id]
    ids = {s["span_id"] for s in own}
    linked = [s for s in spans if s["trace_id"] != trace_id
              and any(link["trace_id"] == trace_id and link["span_id"] in ids for link in s.get("links", []))]
    return own, linked


def _get_json(url: str, timeout_s: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # an operator-given URL
        return json.load(reply)


def _tags(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {t["key"]: t.get("value") for t in items or []}


def from_jaeger_span(span: dict[str, Any], processes: dict[str, Any]) -> Span:
    trace_id = span["traceID"].zfill(32)
    refs = span.get("references") or []
    parent = next((r["spanID"] for r in refs if r.get("refType") == "CHILD_OF" and r["traceID"].zfill(32) == trace_id),
                  None)
    links = [{"trace_id": r["traceID"].zfill(32), "span_id": r["spanID"].zfill(16)} for r in refs
             if r["spanID"] != parent]
    tags = _tags(span.get("tags"))
    start_ns = int(span["startTime"]) * 1000
    error = tags.get("otel.status_code") == "ERROR" or tags.get("error") is True
    return {"trace_id": trace_id, "span_id": span["spanID"].zfill(16),
            "parent_span_id": parent.zfill(16) if parent else None, "name": span["operationName"],
            "kind": str(tags.get("span.kind", "internal")).upper(), "start_ns": start_ns,
            "end_ns": start_ns + int(span["duration"]) * 1000, "attributes": tags, "links": links,
            "status": {"code": "ERROR" if error else "UNSET", "description": tags.get("otel.status_description", "")},
            "events": [], "service.name": processes.get(span.get("processID", ""), {}).get("serviceName", "")}


def fetch_jaeger(base_url: str, trace_id: str) -> list[Span]:
    body = _get_json(f"{base_url.rstrip('/')}/api/traces/{trace_id}")
    return [from_jaeger_span(s, t.get("processes", {})) for t in body.get("data") or [] for s in t["spans"]]


def jaeger_last_trace_id(base_url: str, service: str) -> str:
    query = urllib.parse.urlencode({"service": service, "limit": 1})
    data = _get_json(f"{base_url.rstrip('/')}/api/traces?{query}").get("data") or []
    if not data:
        raise LookupError(f"Jaeger has no traces of service {service}")
    return data[0]["traceID"].zfill(32)
