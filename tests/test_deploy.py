"""deploy/: the compose file and the Kubernetes manifests agree with the code (config fields, ports, drain time),
and the container health check speaks grpc.health.v1."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from grpc_health.v1 import health_pb2

from specmesh.config import DraftConfig, GatewayConfig, VerifierConfig, _flat_fields
from specmesh.rpc.grpc_server import ServiceServer, serve_until_signal

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
CONFIGS = {"GATEWAY": GatewayConfig, "VERIFIER": VerifierConfig, "DRAFT": DraftConfig}
DRAIN_S = inspect.signature(serve_until_signal).parameters["grace_s"].default
SERVICES = {"gateway": "GATEWAY", "verifier": "VERIFIER", "draft": "DRAFT"}


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _k8s_docs() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _check_env_names(env: dict[str, str], where: str) -> None:
    for name in env:
        m = re.fullmatch(r"SPECMESH_(GATEWAY|VERIFIER|DRAFT)_(\w+)", name)
        if m:
            leaves = {dotted.rsplit(".", 1)[-1].upper() for dotted, _ in _flat_fields(CONFIGS[m[1]])}
            assert m[2] in leaves, f"{where}: {name} is not a field of {CONFIGS[m[1]].__name__}"


def test_compose_env_ports_and_health_checks_match_the_code() -> None:
    services = _compose()["services"]
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job.get("static_configs", []) for t in c["targets"]}
    targets |= {f"{n}:{c['port']}" for job in prometheus["scrape_configs"] for c in job.get("dns_sd_configs", [])
                for n in c["names"]}                                 # every replica of a scaled service
    for name, prefix in SERVICES.items():
        svc = services[name]
        env = svc["environment"]
        _check_env_names(env, f"compose {name}")
        port = env[f"SPECMESH_{prefix}_PORT"]
        assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "specmesh.ops.healthcheck", f"127.0.0.1:{port}"]
        assert f"{name}:{env[f'SPECMESH_{prefix}_METRICS_PORT']}" in targets, f"prometheus does not scrape {name}"
        assert float(svc["stop_grace_period"].rstrip("s")) > DRAIN_S
    gateway = services["gateway"]["environment"]
    for name in ("verifier", "draft"):
        port = services[name]["environment"][f"SPECMESH_{name.upper()}_PORT"]
        assert gateway[f"SPECMESH_GATEWAY_{name.upper()}_ADDR"] == f"dns:///{name}:{port}"   # every replica


def test_compose_tls_overlay_uses_real_settings_and_the_certificates_make_certs_writes() -> None:
    overlay = yaml.safe_load((DEPLOY / "docker-compose.tls.yml").read_text())["services"]
    make_certs = (DEPLOY / "make_certs.sh").read_text()
    for name, prefix in SERVICES.items():
        env = overlay[name]["environment"]
        _check_env_names(env, f"compose TLS overlay {name}")
        assert env[f"SPECMESH_{prefix}_TLS_CERT"] == f"/certs/{name}.pem"
        probe = overlay[name]["healthcheck"]["test"]
        assert probe[:4] == ["CMD", "python", "-m", "specmesh.ops.healthcheck"] and "/certs/ca.pem" in probe
        if f"SPECMESH_{prefix}_TLS_CLIENT_CA" in env:                  # mutual TLS: the probe shows a certificate
            assert f"/certs/{name}.pem" in probe
    assert "for name in verifier draft gateway; do" in make_certs            # signed by the internal CA (ca.pem)
    assert "make_leaf client client-ca " in make_certs                       # end users: the separate client CA
    for name in ("verifier", "draft"):                                        # only the gateway may call them
        assert overlay[name]["environment"][f"SPECMESH_{SERVICES[name]}_TLS_ALLOWED_PEERS"] == "gateway"


def _model_service_mounts(services: dict) -> dict[str, list[str]]:
    return {name: [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in services[name]["volumes"]]
            for name in SERVICES}


def test_compose_serves_the_real_pair_by_default_and_tiny_is_an_explicit_overlay() -> None:
    from specmesh.models import REAL_PRESETS

    compose = _compose()
    services = compose["services"]
    assert compose["x-specmesh-image"]["build"]["args"]["FETCH_MODELS"] == "${SPECMESH_FETCH_MODELS:-1}"
    assert services["verifier"]["environment"]["SPECMESH_VERIFIER_MODEL"] == "${SPECMESH_TARGET:-qwen2.5-coder-1.5b}"
    assert services["draft"]["environment"]["SPECMESH_DRAFT_MODEL"] == "${SPECMESH_DRAFT:-qwen2.5-coder-0.5b}"
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"} == set(REAL_PRESETS)
    assert all(m == ["${SPECMESH_MODEL_CACHE:-models}:/models"] for m in _model_service_mounts(services).values())
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert 'if [ "${FETCH_MODELS}" = "1" ]; then specmesh models fetch' in dockerfile
    assert "SPECMESH_CACHE_DIR=/models" in dockerfile
    tiny = yaml.safe_load((DEPLOY / "docker-compose.tiny.yml").read_text())
    assert tiny["services"]["verifier"]["environment"]["SPECMESH_VERIFIER_MODEL"] == "tiny-target"
    assert tiny["services"]["draft"]["environment"]["SPECMESH_DRAFT_MODEL"] == "tiny-draft"
    for name in SERVICES:
        assert tiny["services"][name]["image"] == "specmesh:tiny" != services[name]["image"]
        assert tiny["services"][name]["build"]["args"]["FETCH_MODELS"] == "0"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_tiny_overlay_replaces_the_model_volume_when_merged(tmp_path: Path) -> None:
    files = ["-f", str(DEPLOY / "docker-compose.yml"), "-f", str(DEPLOY / "docker-compose.tiny.yml")]
    result = subprocess.run(["docker-compose", *files, "config"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert all(m == ["models-tiny:/models:rw"] for m in _model_service_mounts(services).values())
    assert services["verifier"]["environment"]["SPECMESH_VERIFIER_MODEL"] == "tiny-target"
    assert services["verifier"]["build"]["args"]["FETCH_MODELS"] == "0"


def test_entrypoint_refuses_a_model_that_is_not_fetched(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SPECMESH_CACHE_DIR": str(tmp_path), "SPECMESH_VERIFIER_MODEL": "qwen2.5-coder-1.5b"}
    result = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), "verifier"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: model preset 'qwen2.5-coder-1.5b' is not fetched into {tmp_path / 'models'}: run "
        "`specmesh models fetch` first (or set SPECMESH_CACHE_DIR to a cache that has it)"]


def test_k8s_probes_and_graceful_termination() -> None:
    docs = _k8s_docs()
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    _check_env_names(config, "k8s ConfigMap")
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    for name, prefix in SERVICES.items():
        pod = deployments[f"specmesh-{name}"]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        port = int(config[f"SPECMESH_{prefix}_PORT"])
        assert container["args"] == [name]
        _check_env_names({e["name"]: e for e in container.get("env", [])}, f"k8s {name} env")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, f"{name} {probe}"
        pre_stop_s = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + DRAIN_S + 5, f"{name}: no time left to drain"
        assert container["resources"]["requests"]["cpu"]
        assert pod["securityContext"]["runAsNonRoot"] is True
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "specmesh-verifier"
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "specmesh_verifier_queue_length"


def test_k8s_gateway_discovers_replicas_through_headless_services() -> None:
    from gateway.discovery import parse_addrs
    docs = _k8s_docs()
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    for name in ("verifier", "draft"):
        (entry,) = parse_addrs(config[f"SPECMESH_GATEWAY_{name.upper()}_ADDR"], name)
        host, port = entry.host_port
        assert entry.dynamic, f"{name}: a fixed address reaches one pod only"
        spec = services[host]
        assert spec["clusterIP"] == "None" and spec["selector"]["app.kubernetes.io/name"] == f"specmesh-{name}"
        assert [p["port"] for p in spec["ports"]] == [port]


async def _healthcheck(addr: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "specmesh.ops.healthcheck", addr,
                                                "--timeout", "2", stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return proc.returncode, out.decode()


@pytest.mark.timeout(60)
async def test_healthcheck_cli_reports_serving_not_serving_and_unreachable() -> None:
    server = ServiceServer([], lambda s: None)
    port = await server.start("127.0.0.1", 0)
    try:
        assert await _healthcheck(f"127.0.0.1:{port}") == (0, f"127.0.0.1:{port}: SERVING\n")
        await server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        code, out = await _healthcheck(f"127.0.0.1:{port}")
        assert code == 1 and "NOT_SERVING" in out
    finally:
        await server.stop(0)
    code, out = await _healthcheck(f"127.0.0.1:{port}")
    assert code == 2 and "UNAVAILABLE" in out


def _exported_names() -> set[str]:
    from specmesh.telemetry.metrics import EngineMetrics, GatewayMetrics

    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    return {m.name + s for reg in (GatewayMetrics().registry, EngineMetrics().registry)
            for m in reg.collect() for s in suffixes[m.type]}


def test_dashboard_queries_only_metrics_the_services_export() -> None:
    panels = json.loads((DEPLOY / "grafana" / "dashboards" / "specmesh.json").read_text())["panels"]
    used = {name for p in panels for t in p["targets"] for name in re.findall(r"specmesh_[a-z_]+", t["expr"])}
    assert used, "dashboard has no specmesh queries"
    assert used <= _exported_names(), f"unknown metrics: {sorted(used - _exported_names())}"
    adapter = yaml.safe_load((DEPLOY / "prometheus-adapter-values.yaml").read_text())
    assert "specmesh_engine_queue_length" in _exported_names()
    assert adapter["rules"]["custom"][0]["name"]["as"] == "specmesh_verifier_queue_length"
