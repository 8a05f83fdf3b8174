"""Every Prometheus metric's HELP says what it counts: none empty, none a placeholder naming only the metric."""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry

from gateway.round_outcomes import RoundOutcomes
from gateway.tier_stats import DraftingStats
from kvstore.base import CacheCounters
from specmesh.telemetry.metrics import (
    MISSING_HELP,
    EngineMetrics,
    GatewayMetrics,
    SessionMetrics,
    StatsCollector,
)
from verifier_service.decode_ahead import AheadCounts


def bad_help(families: Iterable[tuple[str, str]]) -> list[str]:
    """(name, HELP) pairs whose HELP is empty, short, a `group: name` placeholder or just the name in words."""
    bad = []
    for name, doc in families:
        words = re.sub(r"^specmesh_|_total$", "", name).replace("_", " ")
        if (len(doc.split()) < 4 or name in doc or doc.lower().strip() == words or MISSING_HELP in doc
                or re.fullmatch(r"\w+: \w+", doc)):
            bad.append(f"{name}: {doc!r}")
    return bad


def every_registry() -> CollectorRegistry:
    """One registry with every specmesh metric family: the gateway's, an engine's, the session leases' and all the
    plain-int stats the services expose through StatsCollector (each source's full set of keys)."""
    registry = GatewayMetrics().registry
    engine = EngineMetrics(registry)
    engine.watch(lambda: 0, lambda: 0, lambda: 0, lambda: 0)
    SessionMetrics(registry)
    drafting = {**DraftingStats().snapshot(), **{f"cache_store_{k}": 0 for k in vars(CacheCounters())}}
    registry.register(StatsCollector({"drafting": lambda: drafting, "round_outcomes": RoundOutcomes().snapshot,
                                      "verifier": AheadCounts().stats,
                                      "draft": lambda: {"guessed": 0, "guess_accepted": 0}}))
    return registry


def test_every_metric_help_says_what_it_counts() -> None:
    families = [(f.name, f.documentation) for f in every_registry().collect() if f.name.startswith("specmesh_")]
    assert len(families) > 40                        # the walk saw the stats families, not just the gateway's own
    assert bad_help(families) == []


def test_the_check_rejects_placeholders() -> None:
    assert bad_help([("specmesh_draft_guessed", "draft: specmesh_draft_guessed"), ("specmesh_x", ""),
                     ("specmesh_tree_drafts", "tree drafts"), ("specmesh_y", f"y {MISSING_HELP}")]) == [
        "specmesh_draft_guessed: 'draft: specmesh_draft_guessed'", "specmesh_x: ''",
        "specmesh_tree_drafts: 'tree drafts'", f"specmesh_y: 'y {MISSING_HELP}'"]


def test_a_stat_without_help_is_exposed_but_flagged() -> None:
    registry = CollectorRegistry()
    registry.register(StatsCollector({"drafting": lambda: {"brand_new": 3}}))
    (family,) = registry.collect()
    assert family.samples[0].value == 3 and bad_help([(family.name, family.documentation)])
