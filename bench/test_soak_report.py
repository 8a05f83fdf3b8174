"""Fast checks of the soak run's report (no stack, no model): classification, tallies, greedy checks, verdict."""

from __future__ import annotations

from bench.soak_report import (
    CLIENT_CANCEL,
    GreedyChecks,
    Outcome,
    Window,
    classify,
    format_table,
    leaks,
    metric_samples,
    metric_value,
    rss_summary,
    tally,
    verdict,
)


def _outcome(code: str, start: float = 0.0, end: float = 1.0, short_deadline: bool = False,
             kind: str = "short") -> Outcome:
    return Outcome(kind, code, start, end, short_deadline, tokens=3, details=f"{code} message")


def test_soak_classify_expects_only_what_the_run_caused() -> None:
    gateway_down = [Window("gateway", 10.0, 15.0)]
    assert classify(_outcome("OK"), []) == classify(_outcome(CLIENT_CANCEL), []) == "ok"
    assert classify(_outcome("INTERNAL", 11, 12), gateway_down) == "fatal"
    assert classify(_outcome("UNKNOWN"), []) == "fatal"
    assert classify(_outcome("UNAVAILABLE", 8, 10.5), gateway_down) == "expected"        # cut by the kill
    assert classify(_outcome("UNAVAILABLE", 16, 16.1), gateway_down) == "expected"      # within the grace
    assert classify(_outcome("UNAVAILABLE", 30, 31), gateway_down) == "unexpected"      # nothing was down
    assert classify(_outcome("UNAVAILABLE", 1, 9), gateway_down) == "unexpected"        # ended before the kill
    assert classify(_outcome("DEADLINE_EXCEEDED", short_deadline=True), []) == "expected"
    assert classify(_outcome("DEADLINE_EXCEEDED"), []) == "unexpected"
    assert classify(_outcome("RESOURCE_EXHAUSTED", 11, 12), gateway_down) == "unexpected"


def test_soak_tally_counts_codes_classes_and_keeps_messages() -> None:
    outcomes = [_outcome("OK", 100, 101), _outcome("OK", 100, 150), _outcome("INTERNAL", 100, 120, kind="long"),
                _outcome("INTERNAL", 100, 121, kind="long"), _outcome("UNAVAILABLE", 100, 130)]
    counts = tally(outcomes, [], t0=100.0)
    assert counts["requests"] == 5 and counts["tokens"] == 15
    assert counts["by_code"] == {"OK": 2, "INTERNAL": 2, "UNAVAILABLE": 1}
    assert counts["by_class"] == {"ok": 2, "fatal": 2, "unexpected": 1}
    assert counts["by_kind"]["long"] == {"INTERNAL": 2}
    assert counts["seen_s"]["OK"] == [1.0, 50.0] and counts["seen_s"]["INTERNAL"] == [20.0, 21.0]
    assert counts["messages"] == {"fatal INTERNAL": ["long: INTERNAL message"],
                                  "unexpected UNAVAILABLE": ["short: UNAVAILABLE message"]}


def test_soak_greedy_checks_compare_with_the_first_answer() -> None:
    g = GreedyChecks()
    assert g.record("a", 0, [1, 2, 3]) and g.record("a", 4, [1, 2, 3])
    assert not g.record("a", 8, [1, 2, 4])
    assert not g.record("a", 2, [1, 2])
    assert g.record("b", 0, [9])
    assert g.matches == {"a": 2, "b": 1} and g.num_mismatches == 2
    assert g.mismatches["a"] == ["k=8: differs at token 2 (len 3 vs reference 3)",
                                 "k=2: differs at token 2 (len 2 vs reference 3)"]


def test_soak_rss_growth_counts_from_the_last_process() -> None:
    assert rss_summary([]) == {}
    same = rss_summary([(0.0, 7, 100.0), (5.0, 7, 120.0), (10.0, 7, 130.0)])
    assert same == {"start_mb": 100.0, "end_mb": 130.0, "growth_mb": 30.0, "processes": 1, "growth_since_s": 10.0}
    restarted = rss_summary([(0.0, 7, 100.0), (5.0, 8, 90.0), (20.0, 8, 95.0)])
    assert restarted["growth_mb"] == 5.0 and restarted["processes"] == 2 and restarted["growth_since_s"] == 15.0


def test_soak_metric_value_sums_label_sets() -> None:
    text = ("# HELP specmesh_sessions_expired_total x\n# TYPE specmesh_sessions_expired_total counter\n"
            'specmesh_sessions_expired_total{reason="lease"} 2.0\nspecmesh_sessions_expired_total{reason="x"} 1.0\n'
            "specmesh_sessions_expired_created 1.7e+09\nspecmesh_engine_running_sessions 0.0\n")
    assert metric_value(text, "specmesh_sessions_expired_total") == 3.0
    assert metric_value(text, "specmesh_engine_running_sessions") == 0.0
    assert metric_value(text, "specmesh_kv_cache_blocks_used") is None
    assert metric_value("", "anything") is None
    assert metric_samples(text, "specmesh_sessions_expired_total") == {'reason="lease"': 2.0, 'reason="x"': 1.0}
    assert metric_samples(text, "specmesh_engine_running_sessions") == {"": 0.0}


def test_soak_verdict_fails_on_internal_leaks_and_greedy_drift() -> None:
    clean = {"by_code": {"OK": 5, "UNAVAILABLE": 2, "DEADLINE_EXCEEDED": 1}}
    held_zero = {"verifier": {"sessions": 0, "kv_blocks": 0}, "draft": {"sessions": None, "kv_blocks": None}}
    assert verdict(clean, held_zero, GreedyChecks()) == []
    assert leaks({"verifier": {"sessions": 2, "kv_blocks": 0}, "draft": {"kv_blocks": 5}}) == {
        "verifier.sessions": 2, "draft.kv_blocks": 5}
    drift = GreedyChecks()
    drift.record("a", 0, [1])
    drift.record("a", 4, [2])
    reasons = verdict({"by_code": {"OK": 1, "INTERNAL": 3, "UNKNOWN": 1}},
                      {"verifier": {"sessions": 1, "kv_blocks": 4}}, drift)
    assert reasons == ["3 x INTERNAL", "1 x UNKNOWN", "leak: verifier.sessions = 1", "leak: verifier.kv_blocks = 4",
                       "greedy output changed 1 times"]


def test_soak_table_shouts_fatal_codes_and_the_verdict() -> None:
    counts = tally([_outcome("OK"), _outcome("INTERNAL")], [])
    result = {"preset": "tiny", "duration_s": 60.0, "streams": 4, "outcomes": counts, "kills": {"gateway": 1},
              "kill_windows": [["gateway", 12.0, 3.0]], "greedy_checks": GreedyChecks().to_json(),
              "verifier_timeline": {"rows": [[5.0, 2, 30, 0]]},
              "held_at_end": {"verifier": {"sessions": 0, "kv_blocks": 0}, "draft": {"sessions": None}},
              "rss": {"verifier": rss_summary([(0.0, 1, 10.0), (5.0, 1, 12.0)])}, "redis_used_memory": 1000,
              "sessions_expired": {"verifier": 1.0}, "failures": ["1 x INTERNAL"]}
    table = format_table(result)
    assert "INTERNAL" in table and "MUST BE ZERO" in table and "fatal INTERNAL: short: INTERNAL message" in table
    assert "draft     sessions ?" in table and "2/30" in table and table.endswith("FAIL: 1 x INTERNAL")
    assert "abandoned by a live gateway" in table    # 1 expired session, no gateway kill explains it
