"""bench/speedup.py per workload split: the tuning prompts (defaults are chosen on them) and the held-out evaluation
prompts (other languages, tasks and chat styles: the defaults are judged on them), each per category and overall,
with issue 23's goals on both. Pure: testable on plain results (bench/test_workload.py).

Goals per split and length, on layout a (pinned cores; layout b when a did not run), for the `defaults` arm (the
gateway as it ships; the best speculative arm when it did not run): every category's decode speedup >= 1.0x
target-only (defaults that never lose) and overall >= 1.3x.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.common import SPLITS, RequestResult
from bench.speedup_arms import parse_run_key
from bench.speedup_goals import arm_terms, format_goal, headline_arm, limiting_term
from bench.speedup_stats import prompt_id, summarize_arm
from gateway.verify_cost import VerifyCost

GOAL_CATEGORY = 1.0
GOAL_OVERALL = 1.3
DEFAULTS_ARM = "defaults"

Runs = Mapping[str, Mapping[str, list[RequestResult]]]   # run key -> arm -> results


def summarize_splits(runs: Runs, split_of: Mapping[str, str], max_k: int) -> dict[str, dict[str, Any]]:
    """split -> run key -> arm -> summarize_arm rows, over that split's prompts only (`split_of`: prompt id ->
    split); splits without prompts in this run are left out."""
    out: dict[str, dict[str, Any]] = {}
    for split in SPLITS:
        for key, results in runs.items():
            mine = {arm: [r for r in rs if split_of.get(prompt_id(r)) == split] for arm, rs in results.items()}
            if not mine.get("target"):
                continue
            target = {r.id: r for r in mine["target"]}
            out.setdefault(split, {})[key] = {arm: summarize_arm(rs, target, max_k) for arm, rs in mine.items()}
    return out


def goal_row(name: str, value: float, threshold: float, limiting: str) -> dict[str, Any]:
    """One goal in speedup_goals' shape (format_goal prints it)."""
    return {"goal": name, "value": value, "threshold": threshold, "passed": value >= threshold,
            "limiting": "" if value >= threshold else limiting}


def goal_arm(arms: Mapping[str, Any]) -> str:
    """The arm the goals judge: `defaults` when it ran, else the best speculative arm ('' when none ran)."""
    if arms.get(DEFAULTS_ARM, {}).get("overall", {}).get("n"):
        return DEFAULTS_ARM
    return headline_arm(dict(arms))


def _judged_keys(summary: Mapping[str, Any]) -> list[str]:
    """Run keys of the judged layout (a, else b, else the first), by length."""
    layouts = {parse_run_key(k)[0] for k in summary}
    layout = next((name for name in ("a", "b") if name in layouts), min(layouts, default=""))
    return sorted((k for k in summary if parse_run_key(k)[0] == layout), key=lambda k: parse_run_key(k)[1])


def split_goals(splits: Mapping[str, Mapping[str, Any]], c_of: Mapping[str, float] | None = None,
                verify: VerifyCost | None = None) -> list[dict[str, Any]]:
    """Goal rows (speedup_goals' shape) per split and length: each category >= 1.0x, overall >= 1.3x; a missed one
    names the term of the round model that holds it back (`c_of`: layout -> draft/target cost ratio)."""
    c_of, verify = c_of or {}, verify or VerifyCost(0.0)
    out = []
    for split, summary in splits.items():
        for key in _judged_keys(summary):
            arms = summary[key]
            arm = goal_arm(arms)
            if not arm:
                continue
            layout, length = parse_run_key(key)
            for cat, row in arms[arm].items():
                if row.get("n") and row["speedup"]["n"]:
                    threshold = GOAL_OVERALL if cat == "overall" else GOAL_CATEGORY
                    out.append(goal_row(f"[{split}] @{length} {cat} decode speedup, layout {layout}, {arm}",
                                        row["speedup"]["decode_median"], threshold,
                                        limiting_term(arm_terms(row, c_of.get(layout, 0.0), verify))))
    return out


def split_lines(splits: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The printout: per split and run, one line per speculative arm with its decode speedup median per
    category and overall."""
    lines = []
    for split, summary in splits.items():
        for key, arms in summary.items():
            cats = [c for c in arms["target"] if c != "overall"] + ["overall"]
            lines.append(f"[{split} {key}] decode speedup over target-only (median over prompts): "
                         + ", ".join(f"{c} n={arms['target'][c].get('n', 0)}" for c in cats))
            for arm, rows in arms.items():
                if arm == "target" or "@" in arm:
                    continue
                cells = [f"{c} {rows[c]['speedup']['decode_median']:.2f}x" if rows.get(c, {}).get("n") else f"{c} -"
                         for c in cats]
                lines.append(f"  {arm:<12} " + " | ".join(cells))
    return lines


def print_split_report(splits: Mapping[str, Mapping[str, Any]], goals: list[dict[str, Any]]) -> None:
    print("\n" + "\n".join(split_lines(splits)))
    print("\ngoals (issue 23: defaults judged on the held-out eval prompts, the tuning prompts beside them):")
    for goal in goals:
        print(format_goal(goal))
