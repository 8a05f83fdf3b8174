"""Issue 14's goals against a bench/speedup.py report, and which term of the analytic bound holds each one back.

The round model (in target decode steps of the run's own target-only arm): a round yields E tokens (accepted + one
target token) and costs R = E / S steps, S the measured decode speedup. R splits into
    1 (one target step)  +  D = m c (drafting m model tokens at c target steps each, c from the in-process runs;
    m = the draft model's share of the g drafted tokens per round: cache / n-gram / suffix drafts cost no steps)
    +  V = max(0, g + 1 - F) v (verifying the tokens beyond the verifier's F free ones at v steps each,
    --verify-token-cost and --verify-free-tokens; gateway/verify_cost.py)  +  O (the rest: overhead).
Removing one term at a time says which one holds the speedup back most: acceptance (E -> g+1), draft cost (D -> 0),
verify cost (V -> 0) or overhead (O -> 0). Pure: testable on plain dicts (bench/test_bench.py).
"""

from __future__ import annotations

from typing import Any

from bench.speedup_arms import parse_run_key, run_key
from gateway.verify_cost import VerifyCost

GOAL_A = {"overall": 1.6, "code": 2.0, "code-edit": 2.0, "chat": 1.3}
GOAL_B_OVER_2CORE = 1.3
GOAL_STREAMS = 4.0


def round_terms(speedup: float, tokens_per_round: float, drafted_per_round: float, c: float,
                verify_token_cost: float, model_drafted_per_round: float | None = None,
                free_tokens: int = 1) -> dict[str, float]:
    """Per-round cost terms (target steps) and the speedup with each term made ideal."""
    e, g = tokens_per_round, drafted_per_round
    m = g if model_drafted_per_round is None else model_drafted_per_round
    if speedup <= 0 or e <= 0:
        return {}
    r = e / speedup
    d, v = m * c, max(0.0, g + 1 - free_tokens) * verify_token_cost
    o = r - 1.0 - d - v
    hidden = max(0.0, -o)              # R below 1 + D + V: that much drafting ran alongside verification
    ideal = {
        "acceptance": (g + 1.0) / r,
        "draft cost": e / max(r - max(0.0, d - hidden), 1e-9),
        "verify cost": e / max(r - v, 1e-9),
        "overhead": e / max(r - o, 1e-9) if o > 0 else speedup,
    }
    return {"speedup": speedup, "E": e, "g": g, "R": r, "D": d, "V": v, "O": o, "hidden": hidden,
            "bound": e / (1.0 + d), **{f"ideal {k}": x for k, x in ideal.items()}}


def limiting_term(terms: dict[str, float]) -> str:
    """The term whose removal gains most, with the numbers behind it."""
    if not terms:
        return "no rounds measured"
    names = ("acceptance", "draft cost", "verify cost", "overhead")
    worst = max(names, key=lambda n: terms[f"ideal {n}"])
    detail = {
        "acceptance": f"E={terms['E']:.2f} of {terms['g'] + 1:.2f} tokens/round",
        "draft cost": f"D=m*c={terms['D']:.2f} target steps/round"
                      + (f" ({terms['hidden']:.2f} of it hidden behind verification)" if terms["hidden"] else ""),
        "verify cost": f"V={terms['V']:.2f} target steps/round",
        "overhead": f"O={terms['O']:.2f} target steps/round",
    }[worst]
    return (f"{worst}: {detail} (round R={terms['R']:.2f} steps = 1 + D {terms['D']:.2f} + V {terms['V']:.2f} "
            f"+ O {terms['O']:.2f}; {worst} ideal -> {terms[f'ideal {worst}']:.2f}x; bound E/(1+D) "
            f"{terms['bound']:.2f}x)")


def arm_terms(row: dict[str, Any], c: float, verify: VerifyCost) -> dict[str, float]:
    """round_terms of one summary row (summarize_arm's per-category dict)."""
    if not row.get("n") or not row.get("num_rounds"):
        return {}
    model = row.get("sources", {}).get("model", {}).get("drafted", row["num_drafted"])
    return round_terms(row["speedup"]["decode_median"], row["mean_tokens_per_round"],
                       row["num_drafted"] / row["num_rounds"], c, verify.token_cost, model / row["num_rounds"],
                       verify.free_tokens)


def headline_arm(arms: dict[str, Any]) -> str:
    """The speculative arm with the highest overall decode speedup median ('' when none ran)."""
    spec = {a: rows["overall"]["speedup"]["decode_median"] for a, rows in arms.items()
            if a != "target" and "@" not in a and rows.get("overall", {}).get("n")}
    return max(spec, key=lambda a: spec[a]) if spec else ""


def _goal(name: str, value: float, threshold: float, limiting: str = "") -> dict[str, Any]:
    return {"goal": name, "value": value, "threshold": threshold, "passed": value >= threshold,
            "limiting": "" if value >= threshold else limiting}


def goals_for_length(summary: dict[str, Any], length: int, c_of: dict[str, float], verify: VerifyCost,
                     llamacpp: dict[str, Any]) -> list[dict[str, Any]]:
    """Goals (a) and (b) at one max_new_tokens. `c_of`: layout -> draft/target cost ratio;
    `llamacpp`: the peer's summary ({"2": {"target": {"overall": {"tok_s": ...}}}} per thread count)."""
    out = []
    a, b = summary.get(run_key("a", length)), summary.get(run_key("b", length))
    if a and (arm := headline_arm(a)):
        for cat, threshold in GOAL_A.items():
            row = a[arm].get(cat)
            if row and row.get("n"):
                terms = arm_terms(row, c_of.get("a", 0.0), verify)
                out.append(_goal(f"(a) @{length} {cat} decode speedup, layout a, {arm}",
                                 row["speedup"]["decode_median"], threshold, limiting_term(terms)))
    if b and (arm := headline_arm(b)):
        row = b[arm]["overall"]
        terms = arm_terms(row, c_of.get("b", 0.0), verify)
        out.append(_goal(f"(b) @{length} decode speedup over 2-core target-only, layout b, {arm}",
                         row["speedup"]["decode_median"], GOAL_B_OVER_2CORE, limiting_term(terms)))
        if a and (a_arm := headline_arm(a)):
            ratio = a[a_arm]["overall"]["median_decode_tok_s"] / max(b["target"]["overall"]["median_decode_tok_s"],
                                                                      1e-9)
            out.append(_goal(f"(b) @{length} layout-a {a_arm} vs layout-b 2-core target-only (decode tok/s)",
                             ratio, GOAL_B_OVER_2CORE, limiting_term(arm_terms(a[a_arm]["overall"],
                                                                              c_of.get("a", 0.0),
                                                                              verify))))
        peer = llamacpp.get(str(length), {}).get("2", {}).get("target", {}).get("overall", {})
        if peer.get("tok_s"):
            ours = row["aggregate_tok_s"]
            target_ratio = b["target"]["overall"]["aggregate_tok_s"] / peer["tok_s"]
            out.append(_goal(f"(b) @{length} end-to-end tok/s {arm} / llama.cpp target-only 2 threads", ours / peer[
                "tok_s"], 1.0, f"target speed: specmesh target-only is {target_ratio:.2f}x llama.cpp's "
                               f"({b['target']['overall']['aggregate_tok_s']:.2f} vs {peer['tok_s']:.2f} tok/s); "
                               f"then {limiting_term(terms)}"))
    return out


def greedy_goal(problems: list[dict[str, Any]]) -> dict[str, Any]:
    bad = sorted({f"{p['run']} {p['arm']}" for p in problems})
    return {"goal": "greedy output identical to target-only in every stack arm", "value": float(len(problems)),
            "threshold": 0.0, "passed": not problems, "limiting": "; ".join(bad)}


def all_goals(report: dict[str, Any], verify: VerifyCost) -> list[dict[str, Any]]:
    summary = report["summary"]
    lengths = sorted({parse_run_key(k)[1] for k in summary})
    c_of = report.get("cost_ratio", {})
    out = [g for n in lengths for g in goals_for_length(summary, n, c_of, verify,
                                                        report.get("llamacpp", {}).get("summary", {}))]
    out.append(greedy_goal(report.get("problems", [])))
    streams = report.get("streams")
    if streams:
        out.append(_goal("8-stream aggregate / 1 stream", streams["ratio"], GOAL_STREAMS, streams.get("note", "")))
    return out


def format_goal(g: dict[str, Any]) -> str:
    verdict = "PASS" if g["passed"] else "FAIL"
    line = f"{verdict} {g['goal']}: {g['value']:.2f} (goal {g['threshold']:g})"
    return line + (f" -- limited by {g['limiting']}" if g["limiting"] else "")
