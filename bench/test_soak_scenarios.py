"""The soak's abuse scenarios (bench/soak_scenarios.py): how they are chosen and reported (the scenarios themselves
need a running stack: smoke them with the command in bench/README.md)."""

from __future__ import annotations

import pytest

from bench.soak import parse_args
from bench.soak_report import format_scenarios
from bench.soak_scenarios import API_KEYS, PIN_LIMIT, SCENARIOS
from gateway.quotas import TenantLimits, parse_tenant_limits
from specmesh.rpc.security import parse_api_keys


def test_scenarios_are_chosen_by_name() -> None:
    assert parse_args([]).scenarios.split(",") == list(SCENARIOS)
    assert parse_args(["--scenarios", ""]).scenarios == ""
    with pytest.raises(SystemExit):
        parse_args(["--scenarios", "pinning,flood"])


def test_the_soak_keys_give_the_pinning_tenant_its_limit() -> None:
    entries = API_KEYS.split(",")
    assert set(parse_api_keys(entries).values()) == {"soak", "pinner", "victim"}
    assert parse_tenant_limits(entries) == {"pinner": TenantLimits(max_streams=PIN_LIMIT)}


def test_scenario_lines_say_ok_or_fail_with_reasons() -> None:
    lines = format_scenarios({"pinning": {"streams": 6, "failures": []},
                              "slow": {"code": "ABORTED", "failures": ["slow reader: ABORTED"]}})
    assert lines[0] == "scenarios:"
    assert lines[1].split() == ["pinning", "ok", "streams", "6"]
    assert lines[2].split()[:2] == ["slow", "FAIL"] and lines[3] == "  !!! slow reader: ABORTED"
    assert format_scenarios({}) == []
