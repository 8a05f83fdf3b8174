"""Pure statistics for bench/speedup.py: per-position acceptance, the analytic speedup bound, per-arm summaries.

No models, no gRPC: testable on plain lists (bench/test_bench.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from bench.common import RequestResult, aggregate

Round = tuple[int, int, str]     # (num_drafted, num_accepted, draft source) of one verify round


def position_acceptance(rounds: Iterable[Round], max_k: int) -> list[dict[str, float]]:
    """Conditional acceptance per draft position i = 1..max_k: of the rounds whose draft reached position i with
    positions 1..i-1 accepted, the fraction that accepted position i as well. Positions after the first
    rejection were never tested, so they count neither way (the geometric MLE, as gateway/adaptive.py)."""
    reached = [0] * max_k
    accepted = [0] * max_k
    for drafted, num_accepted, _ in rounds:
        for i in range(min(drafted, max_k)):
            if i > num_accepted:
                break
            reached[i] += 1
            accepted[i] += i < num_accepted
    return [{"position": i + 1, "reached": r, "accepted": a, "rate": a / r if r else 0.0}
            for i, (r, a) in enumerate(zip(reached, accepted, strict=True))]


def pooled_acceptance(per_position: Sequence[dict[str, float]]) -> float:
    """a: accepted / reached over all positions (the per-token acceptance a geometric model assumes)."""
    reached = sum(p["reached"] for p in per_position)
    return sum(p["accepted"] for p in per_position) / reached if reached else 0.0


def analytic_speedup(a: float, g: int, c: float) -> float:
    """Expected speedup of speculative decoding (Leviathan et al. 2023) with per-token acceptance a, draft
    length g and draft/target cost ratio c, assuming a (g+1)-token verify costs one target step:

        (1 - a^(g+1)) / ((1 - a) (g c + 1))
    """
    tokens_per_round = g + 1.0 if a >= 1.0 else (1 - a ** (g + 1)) / (1 - a)
    return tokens_per_round / (g * c + 1)


def analytic_bound(summary: dict[str, Any], c: float, g: int, arm: str) -> dict[str, Any]:
    """Measured speedup of one arm against the geometric analytic bound for its measured a and the in-process c."""
    if arm not in summary or not c:
        return {}
    a = summary[arm]["overall"]["pooled_acceptance"]
    limit = analytic_speedup(a, g, c)
    measured = summary[arm]["overall"]["speedup"]["decode_median"]
    return {"arm": arm, "a": a, "g": g, "c": c, "bound": limit, "measured_decode_median": measured,
            "fraction_of_bound": measured / limit if limit else 0.0}


def prompt_id(result: RequestResult) -> str:
    """The workload prompt a request asked (a repeated ask's id carries a `#k` suffix)."""
    return result.id.split("#")[0]


def speedups(spec: Sequence[RequestResult], target: dict[str, RequestResult]) -> dict[str, float]:
    """Speedup of `spec` over the target-only run of the same prompt id: median over requests of the wall-clock
    and decode (after the first token) tok/s ratios, and the aggregate ratio (all tokens / all time)."""
    paired = [(s, target.get(prompt_id(s))) for s in spec if not s.error]
    pairs = [(s, t) for s, t in paired if t is not None and not t.error]
    wall = [s.tok_s / t.tok_s for s, t in pairs if t.tok_s > 0]
    decode = [s.decode_tok_s / t.decode_tok_s for s, t in pairs if t.decode_tok_s > 0 and s.decode_tok_s > 0]
    s_tok, s_time = sum(s.completion_tokens for s, _ in pairs), sum(s.wall_s for s, _ in pairs)
    t_tok, t_time = sum(t.completion_tokens for _, t in pairs), sum(t.wall_s for _, t in pairs)
    agg = (s_tok / s_time) / (t_tok / t_time) if s_time and t_time and t_tok else 0.0
    return {"n": len(pairs), "wall_median": statistics.median(wall) if wall else 0.0,
            "decode_median": statistics.median(decode) if decode else 0.0, "aggregate": agg}


def summarize_arm(results: Sequence[RequestResult], target: dict[str, RequestResult],
                  max_k: int) -> dict[str, Any]:
    """One arm, per category and overall: throughput aggregates, speedups over target-only, acceptance."""
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(r.category, []).append(r)
    groups["overall"] = list(results)
    out = {}
    for name, group in groups.items():
        per_position = position_acceptance((rd for r in group for rd in r.round_log), max_k)
        out[name] = {**aggregate(group), "speedup": speedups(group, target),
                     "position_acceptance": per_position, "pooled_acceptance": pooled_acceptance(per_position)}
    return out


def hf_summary(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """In-process transformers runs (dicts with mode, category, new_tokens, seconds, prompt_id), per mode and
    category: aggregate tok/s and speedup over the `target` mode on the same prompts."""
    out: dict[str, dict[str, Any]] = {}
    target = {r["prompt_id"]: r for r in runs if r["mode"] == "target"}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in mine:
            groups.setdefault(r["category"], []).append(r)
        groups["overall"] = mine
        out[mode] = {}
        for cat, rs in groups.items():
            tok, sec = sum(r["new_tokens"] for r in rs), sum(r["seconds"] for r in rs)
            t_tok = sum(target[r["prompt_id"]]["new_tokens"] for r in rs if r["prompt_id"] in target)
            t_sec = sum(target[r["prompt_id"]]["seconds"] for r in rs if r["prompt_id"] in target)
            tok_s = tok / sec if sec else 0.0
            out[mode][cat] = {"n": len(rs), "tok_s": tok_s,
                              "speedup": tok_s / (t_tok / t_sec) if t_tok and t_sec else 0.0,
                              "identical_to_target": sum(bool(r.get("matches_target", True)) for r in rs)}
    return out
