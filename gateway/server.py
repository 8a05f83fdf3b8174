"""Builds the gateway: the verifier and draft replicas (fixed or discovered by DNS), the tokenizer, the servicer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.channels import internal_channel
from gateway.discovery import Discovery, Resolver, parse_addrs, resolve_dns
from gateway.draft_pool import DraftPool
from gateway.health import VerifierWatch
from gateway.openai_http import add_loopback_port
from gateway.replicas import VerifierPool
from gateway.safe_parse import add_generation_servicer
from gateway.servicer import GenerationServicer, ModelInfo
from gateway.text_stream import IncrementalDetokenizer
from gateway.tiers import build_tiers
from protos.specmesh.v1 import draft_pb2_grpc, generate_pb2, verifier_pb2, verifier_pb2_grpc
from specmesh.config import GatewayConfig
from specmesh.models import resolve_model_dir
from specmesh.ops.warmup import warm_up_async
from specmesh.rpc.grpc_server import ServiceServer
from specmesh.rpc.security import PUBLIC_METHOD_PREFIX, api_key_interceptors, load_api_keys, server_credentials
from specmesh.telemetry.metrics import GatewayMetrics, StatsCollector, start_metrics

log = logging.getLogger(__name__)

T = TypeVar("T")
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def fetch_model_info(pool: VerifierPool, discovery: Discovery, wait_s: float) -> verifier_pb2.ModelInfo:
    """Waits up to wait_s for some verifier replica to answer (it may still be loading its model, or not be in DNS
    yet)."""
    deadline = asyncio.get_running_loop().time() + wait_s
    problem = "no replica found"
    while True:
        await discovery.refresh()
        for replica in pool.all():
            try:
                info: verifier_pb2.ModelInfo = await replica.stub.GetModelInfo(
                    verifier_pb2.GetModelInfoRequest(), timeout=5.0, wait_for_ready=True)
            except grpc.aio.AioRpcError as exc:
                problem = f"{replica.addr}: {exc.code().name} {exc.details()}"
                continue
            replica.report(info)
            return info
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"verifier not reachable ({problem})")
        await asyncio.sleep(0.5)


def stub_maker(stub_type: Callable[[grpc.aio.Channel], T], config: GatewayConfig,
               discovery: Discovery) -> Callable[[str], tuple[T, grpc.aio.Channel]]:
    """One channel per replica address (a discovered IP is checked against its DNS name under TLS)."""
    def make(addr: str) -> tuple[T, grpc.aio.Channel]:
        channel = internal_channel(addr, config.tls, discovery.server_names.get(addr, ""))
        return stub_type(channel), channel
    return make


def public_refusal_counter(metrics: GatewayMetrics) -> Callable[[str, grpc.StatusCode], None]:
    """Counts public calls refused before the servicer ran (API key, undecodable bytes) in the error metric, like
    the servicer's own refusals and the HTTP API's."""
    def count(method: str, code: grpc.StatusCode) -> None:
        if method.startswith(PUBLIC_METHOD_PREFIX):
            metrics.errors.labels(code.name).inc()
    return count


def load_tokenizer(ref: str, cache_dir: str) -> PreTrainedTokenizerBase:
    model_dir = resolve_model_dir(ref, Path(cache_dir) if cache_dir else None)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    IncrementalDetokenizer(tokenizer)       # reads the decoder pipeline once now, not in the first request (~0.5 s)
    return tokenizer


@dataclass
class Gateway:
    """The gateway's gRPC server and what its HTTP API shares with it."""

    server: ServiceServer
    model: ModelInfo
    tokenizer: PreTrainedTokenizerBase
    metrics: GatewayMetrics            # one registry: the metrics port and the HTTP API's /metrics
    watch: VerifierWatch               # readiness: some verifier replica answers
    verifiers: VerifierPool            # the replicas now (discovery keeps it current)
    loopback: str | None = None        # the gRPC server's unix-socket loopback, where one was added (the warm-up)


async def warm_up_gateway(watch: VerifierWatch, target: str, num_tokens: int, api_key: str,
                          wait_s: float = 120.0) -> str:
    """The gateway's own warm-up (SPECMESH_GATEWAY_WARMUP_TOKENS; ServiceServer.warm_up holds SERVING until it
    ends): once some verifier replica answers (waiting up to wait_s), one greedy generation through the gateway's
    own unix-socket loopback (`target`, as the HTTP API's), with its own first API key where it wants one
    (specmesh/ops/warmup.py), so compose's healthcheck or a Kubernetes readiness probe waits for a warm gateway."""
    deadline = time.monotonic() + wait_s
    while not watch.serving and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return await warm_up_async(target, num_tokens, api_key=api_key)


async def build_gateway(config: GatewayConfig, wait_for_verifier_s: float = 600.0,
                        resolver: Resolver = resolve_dns) -> ServiceServer:
    return (await build_gateway_parts(config, wait_for_verifier_s, resolver)).server


async def build_gateway_parts(config: GatewayConfig, wait_for_verifier_s: float = 600.0,
                              resolver: Resolver = resolve_dns) -> Gateway:
    """resolver: how dns:/// names become addresses (tests inject their own)."""
    credentials, keys = server_credentials(config.tls), load_api_keys(config)   # fail fast
    entries = parse_addrs(config.verifier_addr, "verifier_addr")
    if not entries:
        raise ValueError("verifier_addr must name at least one verifier (host:port or dns:///NAME:PORT, "
                         "comma-separated)")
    verifier_discovery = Discovery(entries, lambda addrs: verifiers.set_addrs(addrs), resolver,
                                   config.discovery_interval_s)
    verifiers = VerifierPool(stub_maker(verifier_pb2_grpc.VerifierStub, config, verifier_discovery),
                             policy=config.placement)
    info = await fetch_model_info(verifiers, verifier_discovery, wait_for_verifier_s)
    tokenizer = load_tokenizer(config.tokenizer or info.model_name, config.cache_dir)
    draft, discoveries = None, [verifier_discovery]
    if config.draft_addr:
        draft_discovery = Discovery(parse_addrs(config.draft_addr, "draft_addr"),
                                    lambda addrs: drafts.set_addrs(addrs), resolver, config.discovery_interval_s)
        draft = drafts = DraftPool(stub_maker(draft_pb2_grpc.DraftStub, config, draft_discovery))
        await draft_discovery.refresh()
        discoveries.append(draft_discovery)
    model = ModelInfo(info.model_name, info.max_model_len, frozenset(info.eos_token_ids))
    tiers = build_tiers(config, info.model_name, config.tokenizer or info.model_name, info.vocab_size)
    metrics = GatewayMetrics()
    servicer = GenerationServicer(config, tokenizer, model, verifiers, draft, tiers, metrics)
    log.info("gateway for %s (context %d, draft %s)", info.model_name, info.max_model_len, config.draft_addr or "off")
    refusals = public_refusal_counter(metrics)
    server = ServiceServer([SERVICE_NAME], lambda s: add_generation_servicer(servicer, s), credentials,
                           api_key_interceptors(keys, refusals), on_refused=refusals,
                           max_message_bytes=config.limits.max_body_bytes)
    metrics.registry.register(StatsCollector(server.stats))       # tier hits, draft-link bytes
    server.metrics = start_metrics(config.telemetry, config.host, metrics.registry)
    watch = VerifierWatch(verifiers, server.set_ready, config.health_probe_interval_s,      # gRPC and HTTP health
                          config.health_probe_timeout_s, config.health_probe_failures)
    server.readiness = lambda: watch.serving
    loopback = None
    if config.warmup_tokens > 0:                # the gateway's own warm-up, before it reports SERVING
        loopback = add_loopback_port(server)
        server.warm_up = lambda: warm_up_gateway(watch, loopback, config.warmup_tokens, next(iter(keys), ""))
    watch.start()
    server.on_stop.append(watch.close)
    for discovery in discoveries:                                 # dns:/// names are resolved again and again
        discovery.start()
        server.on_stop.append(discovery.close)
    server.on_stop.append(tiers.close)
    server.stats["drafting"] = tiers.snapshot
    server.stats["round_outcomes"] = servicer.outcomes.snapshot   # specmesh_round_outcomes_* counters
    return Gateway(server, model, tokenizer, metrics, watch, verifiers, loopback)
