"""bench.concurrency's ratios: each pass of a repeated level pairs its own two arms (a shared host drifts between
passes by more than the effects measured), and the summary is their median and spread."""

from __future__ import annotations

from bench.concurrency import level_ratios


def row(streams: int, i: int, mode: str, tok_s: float) -> dict[str, object]:
    return {"streams": streams, "pass": i, "mode": mode, "aggregate_tok_s": tok_s}


def test_each_pass_pairs_its_own_arms_and_the_median_summarises_them() -> None:
    rows = [row(4, 0, "target", 36.6), row(4, 0, "spec", 29.4),       # a slow stretch of the host
            row(4, 1, "spec", 39.6), row(4, 1, "target", 43.3),
            row(4, 2, "target", 40.0), row(4, 2, "spec", 40.0),
            row(8, 3, "target", 45.5), row(8, 3, "spec", 43.1)]
    ratios = level_ratios(rows)
    assert [round(r, 3) for r in ratios[4]["ratios"]] == [0.803, 0.915, 1.0]
    assert round(ratios[4]["median"], 3) == 0.915 and ratios[4]["max"] == 1.0
    assert round(ratios[8]["median"], 3) == round(43.1 / 45.5, 3) and len(ratios[8]["ratios"]) == 1


def test_rows_without_a_pass_field_pair_by_level_and_a_missing_arm_is_no_ratio() -> None:
    rows = [{"streams": 1, "mode": "target", "aggregate_tok_s": 20.0},
            {"streams": 1, "mode": "spec", "aggregate_tok_s": 25.0},
            {"streams": 2, "mode": "spec", "aggregate_tok_s": 30.0}]
    assert level_ratios(rows) == {1: {"ratios": [1.25], "median": 1.25, "min": 1.25, "max": 1.25}}
