"""A request's span tree as a terminal waterfall: one line per span, indented by parentage, with its duration
and a bar placed on the trace's timeline. Engine forwards from other traces appear under the span they link to.
"""

from __future__ import annotations

from collections import defaultdict

from specmesh.telemetry.trace_store import Span

NOTES = {"gen_ai.usage.input_tokens": "in", "gen_ai.usage.output_tokens": "out",
         "specmesh.round.drafted": "drafted", "specmesh.round.accepted": "accepted",
         "specmesh.round.draft_source": "src", "specmesh.batch.num_seqs": "seqs", "specmesh.batch.num_tokens": "tok"}


def format_duration(ns: int) -> str:
    ms = ns / 1e6
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.2f} ms"


def _note(span: Span) -> str:
    attrs = span.get("attributes", {})
    parts = [f"{label}={attrs[key]}" for key, label in NOTES.items() if key in attrs]
    if span.get("status", {}).get("code") == "ERROR":
        parts.append(f"ERROR {span['status'].get('description', '')}".strip())
    return " ".join(parts)


def _bar(span: Span, t0: int, total: int, width: int) -> str:
    start = min(max(span["start_ns"] - t0, 0), total)
    end = min(max(span["end_ns"] - t0, start), total)
    left = int(start / total * width)
    length = max(1, round((end - start) / total * width))
    return "|" + (" " * left + "█" * length).ljust(width)[:width] + "|"


def _rows(own: list[Span], linked: list[Span]) -> list[tuple[str, Span]]:
    ids = {s["span_id"] for s in own}
    children: dict[str, list[tuple[str, Span]]] = defaultdict(list)
    roots = []
    for s in own:
        if s.get("parent_span_id") in ids:
            children[s["parent_span_id"]].append(("", s))
        else:
            roots.append(s)
    for s in linked:
        for link in s.get("links", []):
            if link["span_id"] in ids:
                children[link["span_id"]].append(("⇢ ", s))
    rows: list[tuple[str, Span]] = []

    def walk(marker: str, span: Span, prefix: str, tail: str) -> None:
        rows.append((prefix + marker + span["name"], span))
        kids = sorted(children.get(span["span_id"], []), key=lambda k: k[1]["start_ns"])
        for i, (m, kid) in enumerate(kids):
            last = i == len(kids) - 1
            walk(m, kid, tail + ("└─ " if last else "├─ "), tail + ("   " if last else "│  "))

    for root in sorted(roots, key=lambda s: s["start_ns"]):
        walk("", root, "", "")
    return rows


def render(own: list[Span], linked: list[Span], width: int = 40) -> str:
    if not own:
        raise LookupError("the trace has no spans")
    t0 = min(s["start_ns"] for s in own)
    total = max(max(s["end_ns"] for s in own) - t0, 1)
    rows = _rows(own, linked)
    name_w = min(max(len(label) for label, _ in rows), 72)
    svc_w = max(len(s.get("service.name", "")) for _, s in rows)
    services = sorted({s.get("service.name", "") for s in own} - {""})
    lines = [f"trace {own[0]['trace_id']}  {len(own)} spans (+{len(linked)} linked), {format_duration(total)}, "
             f"services: {', '.join(services)}"]
    for label, s in rows:
        kind = str(s.get("kind", "")).lower().removeprefix("spankind.")
        lines.append(f"{label[:name_w]:<{name_w}}  {s.get('service.name', ''):<{svc_w}}  {kind:<8}  "
                     f"{format_duration(s['end_ns'] - s['start_ns']):>10}  {_bar(s, t0, total, width)}  {_note(s)}"
                     .rstrip())
    return "\n".join(lines)
