"""Every query of the Grafana dashboard reads series the services really export: the tiny stack runs with its
/metrics endpoints, serves one generation and one invalid request, and each metric name in the dashboard's PromQL
must be in the scraped output (of the service its `service="..."` selector names, a Prometheus scrape label)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import socket
import urllib.request
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from draft_service.server import build_draft
from gateway.server import build_gateway
from specmesh.config import DraftConfig, EngineConfig, GatewayConfig, TelemetryConfig, VerifierConfig
from specmesh.ops import client
from tests.stack import Running
from verifier_service.server import build_verifier

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "specmesh.json"
METRIC = re.compile(r"\b(specmesh_[A-Za-z0-9_]+)\b")
SERVICE_SELECTOR = re.compile(r'service="([^"]+)"')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p["targets"]]


def scrape_service_labels() -> set[str]:
    """The `service` label values deploy/prometheus.yml attaches to the specmesh scrape jobs (a static target's
    labels, or a relabel rule of a job that finds its replicas through DNS)."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = config["scrape_configs"]
    static = {c["labels"]["service"] for job in jobs for c in job.get("static_configs", [])
              if "service" in c.get("labels", {})}
    return static | {r["replacement"] for job in jobs for r in job.get("relabel_configs", [])
                     if r.get("target_label") == "service"}


def exported_names(text: str) -> set[str]:
    """Names of the samples in an exposition (histograms as _bucket/_sum/_count, counters as _total)."""
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scraped() -> dict[str, set[str]]:
    """service -> names its /metrics exports after one generation and one rejected request."""
    ports = {name: free_port() for name in ("gateway", "verifier", "draft")}
    engine = EngineConfig(kv_cache_memory_mb=16)
    verifier_server, verifier_engine = build_verifier(VerifierConfig(
        port=0, engine=dataclasses.replace(engine, model="tiny-target"),
        telemetry=TelemetryConfig(metrics_port=ports["verifier"])))
    draft_server, draft_engine = build_draft(DraftConfig(
        port=0, engine=dataclasses.replace(engine, model="tiny-draft"),
        telemetry=TelemetryConfig(metrics_port=ports["draft"])))
    verifier = Running(verifier_server, await verifier_server.start("127.0.0.1", 0), verifier_engine)
    draft = Running(draft_server, await draft_server.start("127.0.0.1", 0), draft_engine)
    # Tiers with the request's fixed k: every round drafts, so the per-position and per-source draft counters exist
    # (suffix drafting chooses per round by measured cost, and may leave a 16-token generation undrafted).
    gateway_server = await build_gateway(GatewayConfig(
        port=0, verifier_addr=verifier.addr, draft_addr=draft.addr, suffix_drafting=False,
        telemetry=TelemetryConfig(metrics_port=ports["gateway"])), wait_for_verifier_s=30)
    gateway = Running(gateway_server, await gateway_server.start("127.0.0.1", 0))
    try:
        request = client.make_request("def fibonacci(n):", max_new_tokens=16, ignore_eos=True, num_draft_tokens=3)
        responses = [r async for r in client.stream(gateway.addr, request, timeout_s=120)]
        assert responses[-1].usage.completion_tokens == 16
        with pytest.raises(grpc.RpcError):
            _ = [r async for r in client.stream(gateway.addr, client.make_request("x", temperature=-1))]
        texts = await asyncio.gather(*(asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
                                       for port in ports.values()))
        yield {name: exported_names(text) for name, text in zip(ports, texts, strict=True)}
    finally:
        for running in (gateway, draft, verifier):
            await running.stop()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def test_dashboard_has_the_panels_users_need() -> None:
    titles = {title for title, _ in dashboard_queries()}
    assert {"Verifier: batched forward time", "Draft service: batched forward time",
            "Draft length and acceptance per position", "KV blocks and sessions held"} <= titles
    by_title: dict[str, list[str]] = {}
    for title, expr in dashboard_queries():
        by_title.setdefault(title, []).append(expr)
    assert all('service="verifier"' in e for e in by_title["Verifier: batched forward time"])
    assert all('service="draft"' in e for e in by_title["Draft service: batched forward time"])
    assert any("specmesh_draft_length_tokens" in e for e in by_title["Draft length and acceptance per position"])
    assert not any("engine_forward" in e for title, e in dashboard_queries() if "batched forward" not in title)
    composition = by_title["Verifier: step composition, decode vs prefill tokens"]
    assert all("specmesh_engine_step_tokens" in e and 'service="verifier"' in e for e in composition)
    assert all("by (kind)" in e for e in composition)
    waits = by_title["Verifier: wait behind prefill"]
    assert waits and all("specmesh_engine_prefill_wait_seconds_bucket" in e for e in waits)


def test_service_selectors_match_the_prometheus_scrape_labels() -> None:
    used = {service for _, expr in dashboard_queries() for service in SERVICE_SELECTOR.findall(expr)}
    assert used and used <= scrape_service_labels() == {"gateway", "verifier", "draft"}


def test_every_dashboard_metric_is_exported(scraped: dict[str, set[str]]) -> None:
    everywhere = set().union(*scraped.values())
    missing = []
    for title, expr in dashboard_queries():
        services = SERVICE_SELECTOR.findall(expr) or list(scraped)
        for name in METRIC.findall(expr):
            if not any(name in scraped[s] for s in services):
                missing.append(f"{title}: {name} (in {'/'.join(services)}; exported anywhere: {name in everywhere})")
        if expr.startswith("histogram_quantile"):
            assert all(n.endswith("_bucket") for n in METRIC.findall(expr)), expr
    assert missing == []


def test_engine_metrics_come_from_both_model_services(scraped: dict[str, set[str]]) -> None:
    for name in ("specmesh_engine_forward_seconds_bucket", "specmesh_kv_cache_blocks_used",
                 "specmesh_kv_cache_blocks_free", "specmesh_engine_running_sessions"):
        assert name in scraped["verifier"] and name in scraped["draft"] and name not in scraped["gateway"]
