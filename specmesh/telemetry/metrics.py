"""Prometheus metrics of the gateway and of the model engines, each in its own registry, and /metrics.

Names follow Prometheus conventions: `specmesh_` prefix, base units in the name (`_seconds`), `_total` on
counters (added by prometheus_client), ratios as `_ratio`. Each service instance owns a CollectorRegistry, so
several services can run in one process (the tests) and tests can read a service's numbers directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from specmesh.config import TelemetryConfig

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DRAFT_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
BATCH_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096)
STEP_TOKEN_BUCKETS = (0, *BATCH_TOKEN_BUCKETS)
PREFILL_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_KINDS = ("decode", "prefill")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.ttft = Histogram("specmesh_time_to_first_token_seconds", "Time from request to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specmesh_inter_token_latency_seconds",
                             "Time between streamed tokens (a round's wait spread over its tokens)",
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("specmesh_request_duration_seconds", "End-to-end latency of finished requests",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specmesh_prompt_tokens",
                                     "Prompt tokens of the requests that started generating (after the chat template)",
                                     registry=r)
        self.prompt_cached_tokens = Counter("specmesh_prompt_cached_tokens",
                                            "Prompt tokens whose KV the verifier replica already held (prefix cache "
                                            "hits at StartSession)", registry=r)
        self.generation_tokens = Counter("specmesh_generation_tokens", "Tokens returned to clients", registry=r)
        self.requests = Counter("specmesh_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.errors = Counter("specmesh_request_errors", "Failed requests by gRPC status code", ["code"],
                              registry=r)
        self.draft_tokens = Counter("specmesh_draft_tokens", "Draft tokens sent for verification", ["source"],
                                    registry=r)
        self.accepted_tokens = Counter("specmesh_draft_accepted_tokens",
                                       "Draft tokens the verifier accepted, by draft source", ["source"],
                                       registry=r)
        self.position_drafted = Counter("specmesh_draft_position_drafted_tokens",
                                        "Rounds with a draft token at this 0-based position", ["position"],
                                        registry=r)
        self.position_accepted = Counter("specmesh_draft_position_accepted_tokens",
                                         "Rounds whose draft token at this 0-based position was accepted",
                                         ["position"], registry=r)
        self.draft_length = Histogram("specmesh_draft_length_tokens", "Draft length in use per round",
                                      buckets=DRAFT_LENGTH_BUCKETS, registry=r)
        self.acceptance = Histogram("specmesh_request_acceptance_ratio", "Accepted / drafted tokens per request",
                                    buckets=RATIO_BUCKETS, registry=r)
        self.tenant_refusals = Counter("specmesh_tenant_refusals", "Requests refused by their tenant's quota "
                                       "(gateway/quotas.py), by tenant and limit", ["tenant", "limit"], registry=r)
        self.tenant_streams = Gauge("specmesh_tenant_streams", "Generations open per tenant", ["tenant"], registry=r)
        self.failovers = Counter("specmesh_gateway_failovers",
                                 "Streams whose verifier session moved to another replica mid-stream, by reason "
                                 "(unavailable, lost: health or discovery, draining) and outcome (moved, failed)",
                                 ["reason", "outcome"], registry=r)

    def observe_round(self, num_drafted: int, num_accepted: int, source: str) -> None:
        self.draft_length.observe(num_drafted)
        if num_drafted == 0:
            return
        self.draft_tokens.labels(source).inc(num_drafted)
        self.accepted_tokens.labels(source).inc(num_accepted)
        for position in range(num_drafted):
            self.position_drafted.labels(str(position)).inc()
            if position < num_accepted:
                self.position_accepted.labels(str(position)).inc()


class EngineMetrics:
    """A model engine (verifier or draft service): queue, sessions, KV blocks, batched forwards."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.queue_length = Gauge("specmesh_engine_queue_length", "Work items waiting for a forward", registry=r)
        self.sessions = Gauge("specmesh_engine_running_sessions", "Sessions held by the engine", registry=r)
        self.kv_used = Gauge("specmesh_kv_cache_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_free = Gauge("specmesh_kv_cache_blocks_free", "KV cache blocks allocatable", registry=r)
        self.batch_size = Histogram("specmesh_engine_batch_size", "Sequences per batched forward",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_tokens = Histogram("specmesh_engine_batch_tokens", "Tokens per batched forward",
                                      buckets=BATCH_TOKEN_BUCKETS, registry=r)
        self.forward_seconds = Histogram("specmesh_engine_forward_seconds", "Duration of one batched forward",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.step_tokens = Histogram(
            "specmesh_engine_step_tokens", "Tokens per engine step by kind (every step observes both, 0 included): "
            "decode = work of sequences already decoding (verifies, decoding ahead), prefill = prompt or "
            "recomputed context chunks; _sum per kind is the total tokens of that kind",
            ["kind"], buckets=STEP_TOKEN_BUCKETS, registry=r)
        for kind in STEP_KINDS:
            self.step_tokens.labels(kind)
        self.prefill_wait = Histogram(
            "specmesh_engine_prefill_wait_seconds", "Per decode request with a waiting caller (a verify of a "
            "running session): seconds between its submission and the step that ran it during which forwards "
            "carrying prefill ran (0 when it waited behind none)", buckets=PREFILL_WAIT_BUCKETS, registry=r)
        self.cpu_wait = Counter(
            "specmesh_engine_cpu_wait_seconds", "Seconds the engine thread and the kernel pool's workers waited for a "
            "core during forwards (runnable, not running: other tasks on the engine's cores; Linux schedstat)",
            registry=r)

    def watch(self, queue_length: Callable[[], int], sessions: Callable[[], int], kv_used: Callable[[], int],
              kv_free: Callable[[], int]) -> None:
        """Gauges read at scrape time (plain int reads of engine state)."""
        self.queue_length.set_function(queue_length)
        self.sessions.set_function(sessions)
        self.kv_used.set_function(kv_used)
        self.kv_free.set_function(kv_free)


class SessionMetrics:
    """Session leases of a model service (specmesh/rpc/leases.py), in the engine's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.expired = Counter("specmesh_sessions_expired", "Sessions ended because no call came for the lease period",
                               registry=registry)


# HELP of every counter family StatsCollector exposes (plain-int stats of gateway/tier_stats.py, kvstore's
# CacheCounters, gateway/round_outcomes.py, verifier_service/decode_ahead.py and the draft engine's guesses).
STATS_HELP: dict[str, str] = {
    "specmesh_draft_tier_hits": "Rounds in which this drafting tier (cache, ngram, model) supplied the draft",
    "specmesh_draft_tier_misses": "Rounds in which this drafting tier was asked for a draft and had none",
    "specmesh_draft_tier_drafted_tokens": "Draft tokens this drafting tier proposed for verification",
    "specmesh_draft_tier_accepted_tokens": "Draft tokens of this drafting tier the verifier accepted",
    "specmesh_draft_link_bytes": "Serialized bytes on the gateway's draft link: Propose requests sent to the draft "
                                 "service, responses received from it (direction)",
    "specmesh_drafting_prefetch_sent": "Next-block Propose calls the gateway sent while the verifier worked",
    "specmesh_drafting_prefetch_hits": "Prefetched blocks whose guess came true: rounds drafted without waiting on "
                                       "the draft link",
    "specmesh_drafting_tree_drafts": "Suffix drafting: rounds drafted as a token tree (branches, or model + suffix)",
    "specmesh_drafting_cache_store_lookups": "Reads of the draft cache (in-process or Redis)",
    "specmesh_drafting_cache_store_hits": "Draft-cache reads that found a verified continuation",
    "specmesh_drafting_cache_store_errors": "Failed draft-cache reads or write batches (store down, timeout)",
    "specmesh_drafting_cache_store_records": "Verified continuations queued for writing to the draft cache",
    "specmesh_drafting_cache_store_dropped": "Verified continuations not written to the draft cache: write queue "
                                             "full or store unavailable",
    "specmesh_round_outcomes_rounds": "Drafted rounds verified (the total the other round-outcome counters split)",
    "specmesh_round_outcomes_all_accepted": "Drafted rounds whose whole main chain the target accepted",
    "specmesh_round_outcomes_bonus_guessed": "All-accepted rounds whose bonus target token the prefetched draft "
                                             "guessed",
    "specmesh_round_outcomes_bonus_missed": "All-accepted rounds whose bonus target token the prefetched draft "
                                            "did not guess",
    "specmesh_round_outcomes_rejected_alt_hit": "Rounds where the target rejected a chain token and accepted one of "
                                                "its tree alternatives",
    "specmesh_round_outcomes_rejected_alt_miss": "Rounds rejected at a position with tree alternatives, none of them "
                                                 "the target's choice",
    "specmesh_round_outcomes_rejected_no_alt": "Rounds rejected at a position without alternatives (every rejection "
                                               "of a plain chain)",
    "specmesh_round_outcomes_branch_continuation_ready": "Overlap: rounds whose next drafts were prefetched after "
                                                         "the alternative the target then took",
    "specmesh_verifier_ahead_tokens": "Verifier decoding ahead while a session waits, by outcome: decoded (tokens), "
                                      "delivered (of them, received by a caller), interrupted (ahead steps that gave "
                                      "way to a verify), guessed / guess_accepted (prompt-lookup guesses run / equal "
                                      "to the target's tokens)",
    "specmesh_draft_guessed": "Prompt-lookup guesses run in the draft service's greedy forwards",
    "specmesh_draft_guess_accepted": "Prompt-lookup guesses equal to the draft model's own choice (draft tokens "
                                     "without a forward of their own)",
}
MISSING_HELP = "(no description: add it to STATS_HELP in specmesh/telemetry/metrics.py)"

TIER_FIELDS = {"hits": "specmesh_draft_tier_hits", "misses": "specmesh_draft_tier_misses",
               "drafted": "specmesh_draft_tier_drafted_tokens", "accepted": "specmesh_draft_tier_accepted_tokens"}


def _family_of(group: str, key: str) -> tuple[str, dict[str, str]]:
    """Counter name and labels of one plain-int stat (drafting tiers, the draft link and the verifier's decoding
    ahead get labels)."""
    if key.startswith("draft_bytes_"):
        return "specmesh_draft_link_bytes", {"direction": key.removeprefix("draft_bytes_")}
    if group == "verifier" and key.startswith("ahead_"):
        return "specmesh_verifier_ahead_tokens", {"outcome": key.removeprefix("ahead_")}
    tier, _, field = key.partition("_")
    if tier in ("cache", "ngram", "model") and field in TIER_FIELDS:
        return TIER_FIELDS[field], {"tier": tier}
    return f"specmesh_{group}_{key}", {}


class StatsCollector(Collector):
    """Exposes `ServiceServer.stats` (name -> snapshot of plain-int counters) as Prometheus counters."""

    def __init__(self, stats: Mapping[str, Callable[[], dict[str, int]]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        families: dict[str, CounterMetricFamily] = {}
        for group, snapshot in list(self.stats.items()):
            for key, value in snapshot().items():
                name, labels = _family_of(group, key)
                if name not in families:
                    families[name] = CounterMetricFamily(name, STATS_HELP.get(name, f"{group} {key} {MISSING_HELP}"),
                                                         labels=sorted(labels))
                families[name].add_metric([labels[k] for k in sorted(labels)], value)
        yield from families.values()


@dataclass
class MetricsServer:
    httpd: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return self.httpd.server_port

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """GET /metrics on host:port (0 = any free port) from a daemon thread."""
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(httpd, thread)


def start_metrics(config: TelemetryConfig, host: str, registry: CollectorRegistry) -> MetricsServer | None:
    """The service's /metrics endpoint when `metrics_port` > 0, else None."""
    return serve_metrics(registry, host, config.metrics_port) if config.metrics_port > 0 else None
