"""Pure bookkeeping for bench/soak.py: outcomes and whether each was expected, greedy exactness, RSS growth,
Prometheus text, the verdict and the printed table. Plain data in, plain data out
(tested in bench/test_soak_report.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CLIENT_CANCEL = "CANCELLED_BY_CLIENT"       # the client closed the stream early (not a gRPC status)
FATAL_CODES = ("INTERNAL", "UNKNOWN")       # must never happen
KILL_GRACE_S = 2.0                          # a stream ending this long after a gateway came back still counts


@dataclass
class Outcome:
    """One request as the client saw it."""
    kind: str                  # "short", "long" (near the context limit) or a greedy check prompt's name
    code: str                  # "OK", CLIENT_CANCEL or a gRPC status code name
    started_s: float           # monotonic clock
    ended_s: float
    short_deadline: bool = False
    tokens: int = 0
    details: str = ""          # the gRPC error message, if any


@dataclass(frozen=True)
class Window:
    """A service down, from its SIGKILL until it was SERVING again (monotonic clock)."""
    service: str
    killed_s: float
    up_s: float


def during_window(o: Outcome, windows: Iterable[Window], grace_s: float = KILL_GRACE_S) -> bool:
    """Did the request overlap a window (a gateway kill cuts streams and refuses new ones until it is back)?"""
    return any(o.started_s <= w.up_s + grace_s and o.ended_s >= w.killed_s for w in windows)


def classify(o: Outcome, gateway_windows: Sequence[Window]) -> str:
    """'ok', 'expected' (cancels, short deadlines, cuts by a gateway kill), 'fatal' (INTERNAL/UNKNOWN) or
    'unexpected' (anything else: e.g. UNAVAILABLE while only the draft service or Redis was down)."""
    if o.code in ("OK", CLIENT_CANCEL):
        return "ok"
    if o.code in FATAL_CODES:
        return "fatal"
    if o.code == "DEADLINE_EXCEEDED" and o.short_deadline:
        return "expected"
    if o.code in ("UNAVAILABLE", "CANCELLED") and during_window(o, gateway_windows):
        return "expected"
    return "unexpected"


def tally(outcomes: Sequence[Outcome], gateway_windows: Sequence[Window], t0: float = 0.0,
          max_messages: int = 5) -> dict[str, Any]:
    """Counts by code and by class, per kind; when each code was first and last seen (seconds after `t0`, by the
    request's end); the first distinct messages of every non-ok class and code."""
    seen_s: dict[str, list[float]] = {}
    by_code: Counter[str] = Counter()
    by_class: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {}
    messages: dict[str, list[str]] = {}
    for o in outcomes:
        cls = classify(o, gateway_windows)
        by_code[o.code] += 1
        by_class[cls] += 1
        by_kind.setdefault(o.kind, Counter())[o.code] += 1
        span = seen_s.setdefault(o.code, [o.ended_s - t0, o.ended_s - t0])
        span[0], span[1] = min(span[0], o.ended_s - t0), max(span[1], o.ended_s - t0)
        if cls in ("fatal", "unexpected"):
            seen = messages.setdefault(f"{cls} {o.code}", [])
            text = f"{o.kind}: {o.details}"
            if text not in seen and len(seen) < max_messages:
                seen.append(text)
    return {"requests": len(outcomes), "tokens": sum(o.tokens for o in outcomes), "by_code": dict(by_code),
            "by_class": dict(by_class), "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
            "seen_s": {code: [round(a, 1), round(b, 1)] for code, (a, b) in sorted(seen_s.items())},
            "messages": messages}


@dataclass
class GreedyChecks:
    """A fixed greedy prompt asked again and again must give the same tokens every time it completes OK."""
    reference: dict[str, list[int]] = field(default_factory=dict)
    matches: Counter[str] = field(default_factory=Counter)
    mismatches: dict[str, list[str]] = field(default_factory=dict)

    def record(self, name: str, num_draft_tokens: int, token_ids: Sequence[int]) -> bool:
        """Stores the first OK answer as the reference; False (and a note) when a later one differs."""
        ref = self.reference.setdefault(name, list(token_ids))
        if list(token_ids) == ref:
            self.matches[name] += 1
            return True
        at = next((i for i, (a, b) in enumerate(zip(ref, token_ids, strict=False)) if a != b),
                  min(len(ref), len(token_ids)))
        self.mismatches.setdefault(name, []).append(
            f"k={num_draft_tokens}: differs at token {at} (len {len(token_ids)} vs reference {len(ref)})")
        return False

    @property
    def num_mismatches(self) -> int:
        return sum(len(v) for v in self.mismatches.values())

    def to_json(self) -> dict[str, Any]:
        return {"matches": dict(self.matches), "mismatches": self.mismatches,
                "reference_lengths": {k: len(v) for k, v in self.reference.items()}}


def rss_summary(samples: Sequence[tuple[float, int, float]]) -> dict[str, Any]:
    """One service's (time, pid, RSS MB) samples -> start/end RSS and growth. After a restart (pid changed) the
    growth is counted from the first sample of the last process, which is what a leak in it would show."""
    if not samples:
        return {}
    last_pid = samples[-1][1]
    first_of_last = next(s for s in samples if s[1] == last_pid)
    pids = list(dict.fromkeys(s[1] for s in samples))
    return {"start_mb": round(samples[0][2], 1), "end_mb": round(samples[-1][2], 1),
            "growth_mb": round(samples[-1][2] - first_of_last[2], 1), "processes": len(pids),
            "growth_since_s": round(samples[-1][0] - first_of_last[0], 1)}


def metric_value(text: str, name: str) -> float | None:
    """Sum of a metric's samples (all label sets) in Prometheus text format; None when the metric is absent."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        if sample.split("{", 1)[0] == name:
            total += float(value)
            found = True
    return total if found else None


def metric_samples(text: str, name: str) -> dict[str, float]:
    """A metric's samples by label set, e.g. {'code="CANCELLED"': 4.0} ('' for no labels)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        metric, _, labels = sample.partition("{")
        if metric == name:
            samples[labels.rstrip("}")] = float(value)
    return samples


def leaks(held: Mapping[str, Mapping[str, int | None]]) -> dict[str, int]:
    """Non-zero held counts at the end, e.g. {'verifier.sessions': 2}; None (could not be read) is no leak."""
    return {f"{svc}.{what}": n for svc, counts in held.items() for what, n in counts.items() if n}


def verdict(counts: Mapping[str, Any], held: Mapping[str, Mapping[str, int | None]],
            greedy: GreedyChecks) -> list[str]:
    """Reasons to fail the run (empty = pass): INTERNAL/UNKNOWN outcomes, held KV blocks or sessions, greedy drift."""
    reasons = [f"{n} x {code}" for code, n in counts["by_code"].items() if code in FATAL_CODES]
    reasons += [f"leak: {name} = {n}" for name, n in leaks(held).items()]
    if greedy.num_mismatches:
        reasons.append(f"greedy output changed {greedy.num_mismatches} times")
    return reasons


def format_table(result: Mapping[str, Any]) -> str:
    """The human summary printed at the end of a run."""
    c = result["outcomes"]
    lines = [f"soak {result['preset']}: {result['duration_s']:.0f} s, {result['streams']} streams, "
             f"{c['requests']} requests, {c['tokens']} tokens",
             "outcome                 count"]
    lines += [f"  {code:<22}{n:>6}   seen {c['seen_s'][code][0]:.0f}..{c['seen_s'][code][1]:.0f} s"
              + ("   <-- MUST BE ZERO" if code in FATAL_CODES else "")
              for code, n in sorted(c["by_code"].items(), key=lambda kv: -kv[1])]
    lines.append("  classes: " + ", ".join(f"{k} {v}" for k, v in sorted(c["by_class"].items())))
    for key, msgs in c["messages"].items():
        lines += [f"  !!! {key}: {m}" for m in msgs]
    lines.append("kills: " + (", ".join(f"{k} {v}" for k, v in result["kills"].items()) or "none")
                 + "  (at s: " + ", ".join(f"{svc} {at:.0f}" for svc, at, _ in result["kill_windows"]) + ")")
    g = result["greedy_checks"]
    lines.append(f"greedy checks: {dict(g['matches'])} identical, {sum(len(v) for v in g['mismatches'].values())} "
                 "differing")
    lines += [f"  !!! {name}: {m}" for name, ms in g["mismatches"].items() for m in ms]
    rows = result["verifier_timeline"]["rows"]
    lines.append("verifier sessions / KV blocks used, every 5 s: " + " ".join(f"{r[1]}/{r[2]}" for r in rows))
    lines.append("held at the end (must be 0):")
    for svc, counts in result["held_at_end"].items():
        lines.append(f"  {svc:<10}" + "  ".join(f"{k} {'?' if v is None else v}" for k, v in counts.items()))
    lines.append("RSS MB (start -> end, growth of the last process):")
    for svc, r in result["rss"].items():
        if r:
            lines.append(f"  {svc:<10}{r['start_mb']:>8.1f} -> {r['end_mb']:>8.1f}  {r['growth_mb']:+.1f} "
                         f"over {r['growth_since_s']:.0f} s ({r['processes']} process(es))")
    lines.append(f"redis used_memory: {result['redis_used_memory']}")
    bound = result.get("sessions_expired_explained_by_kills", 0)
    expired = {svc: n for svc, n in result["sessions_expired"].items() if n is not None}
    lines.append(f"sessions expired by lease: {result['sessions_expired']} (gateway kills x streams = {bound})"
                 + ("   !!! more than the gateway kills explain: sessions abandoned by a live gateway?"
                    if any(n > bound for n in expired.values()) else ""))
    lines += format_scenarios(result.get("scenarios", {}))
    lines.append("PASS" if not result["failures"] else "FAIL: " + "; ".join(result["failures"]))
    return "\n".join(lines)


def format_scenarios(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The abuse scenarios' lines (bench/soak_scenarios.py): what each saw, ok or FAIL with its reasons."""
    lines = ["scenarios:"] if results else []
    for name, result in results.items():
        shown = ", ".join(f"{k} {v}" for k, v in result.items() if k != "failures")
        lines.append(f"  {name:<9}{'FAIL' if result['failures'] else 'ok  '}  {shown}")
        lines += [f"  !!! {f}" for f in result["failures"]]
    return lines
