"""Fair share per tenant: concurrent streams, queued tokens and a token rate, configured per API key in the keys
file.

An entry `KEY:TENANT:streams=4,tokens=20000,rate=500` (in SPECMESH_GATEWAY_API_KEYS, whose entries are
comma-separated, write `streams=4;tokens=20000;rate=500`) gives TENANT (every key bound to it shares the budget):
- `streams`: generations open at once (a stream that does not read holds its slot until it ends);
- `tokens`: queued tokens, the prompt tokens + max_new_tokens of its open generations together;
- `rate`: tokens per second admitted (prompt + max_new_tokens of each request, charged when it starts) from a
  bucket holding RATE_BURST_S seconds' worth; the retry hint says when the bucket will hold the request.
Tenants without limits of their own get SPECMESH_GATEWAY_TENANT_MAX_STREAMS / ..._TENANT_MAX_QUEUED_TOKENS /
..._TENANT_TOKENS_PER_S (0 = unlimited, the default). Over a limit: RESOURCE_EXHAUSTED (HTTP 429) naming the
limit, with a retry hint: gRPC trailing metadata `grpc-retry-pushback-ms` and HTTP `Retry-After`
(`retry_metadata`, `retry_after_header`). The same hint goes with the gateway's other overload refusals (the
verifier's RESOURCE_EXHAUSTED / UNAVAILABLE).
Refusals are counted per tenant in `specmesh_tenant_refusals_total{tenant, limit}` and open streams in
`specmesh_tenant_streams{tenant}`; tenants named in the keys file are labelled by name, any other as "other" (without
API keys the tenant is whatever a header says, so its name would be an unbounded label).

The bookkeeping (TenantQuotas, Ticket) is plain numbers with an injected clock, no I/O; `admit_or_abort` is the
servicer's call.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from specmesh.config import GatewayConfig
from specmesh.rpc.security import DEFAULT_TENANT, api_key_entries, parse_api_keys, split_entry, unbound_key_tenant
from specmesh.telemetry.metrics import GatewayMetrics

if TYPE_CHECKING:
    from gateway.request_telemetry import RequestTelemetry
    from gateway.validation import GenerationParams

PUSHBACK_KEY = "grpc-retry-pushback-ms"
LIMIT_NAMES = {"streams": "max_streams", "tokens": "max_queued_tokens", "rate": "tokens_per_s"}
RATE_BURST_S = 10.0             # a tenant's rate bucket holds this many seconds of its rate


@dataclass(frozen=True)
class TenantLimits:
    max_streams: int = 0           # generations open at once; 0 = unlimited
    max_queued_tokens: int = 0     # prompt + max_new_tokens of the open generations together; 0 = unlimited
    tokens_per_s: int = 0          # prompt + max_new_tokens admitted per second (a bucket); 0 = unlimited


@dataclass(frozen=True)
class Refusal:
    limit: str                     # "streams", "tokens" or "rate"
    message: str
    retry_after_s: float


def parse_limits(text: str, where: str) -> TenantLimits:
    """`streams=4,tokens=20000,rate=500` (any of them, or none; `;` separates them too: needed inside the
    comma-separated SPECMESH_GATEWAY_API_KEYS) -> TenantLimits; ValueError naming `where` and the keys."""
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.replace(";", ",").split(","))):
        name, _, raw = (p.strip() for p in item.partition("="))
        if name not in LIMIT_NAMES or not raw.isdigit():
            raise ValueError(f"{where}: limits must look like streams=N,tokens=N,rate=N (non-negative integers), "
                             f"got {item!r}")
        values[LIMIT_NAMES[name]] = int(raw)
    return TenantLimits(**values)


def parse_tenant_limits(entries: Iterable[str]) -> dict[str, TenantLimits]:
    """{tenant: its limits} from `KEY:TENANT:LIMITS` entries; two entries of a tenant must not disagree."""
    out: dict[str, TenantLimits] = {}
    for number, entry in enumerate(entries, 1):
        parts = split_entry(entry)
        if parts is None or not parts[2]:
            continue
        limits = parse_limits(parts[2], f"API key entry {number}")
        if out.get(parts[1], limits) != limits:
            raise ValueError(f"API key entry {number}: tenant {parts[1]!r} already has other limits")
        out[parts[1]] = limits
    return out


def retry_metadata(retry_after_s: float) -> tuple[tuple[str, str], ...]:
    return ((PUSHBACK_KEY, str(max(1, round(retry_after_s * 1000)))),)


def retry_after_header(trailing: Sequence[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """`Retry-After` (whole seconds, at least 1) from a gRPC answer's pushback metadata; {} without one."""
    for key, value in trailing or ():
        if key == PUSHBACK_KEY:
            text = value.decode() if isinstance(value, bytes) else value
            if text.isdigit():
                return {"Retry-After": str(max(1, math.ceil(int(text) / 1000)))}
    return {}


def overload_metadata(code: grpc.StatusCode, retry_after_s: float) -> tuple[tuple[str, str], ...]:
    """The retry hint for a relayed overload refusal (RESOURCE_EXHAUSTED, UNAVAILABLE); () for other codes."""
    overloaded = code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
    return retry_metadata(retry_after_s) if overloaded else ()


class Ticket:
    """An admitted generation's share; `release()` once it ended (idempotent). `on_release`: e.g. the open-streams
    gauge's dec."""

    def __init__(self, quotas: TenantQuotas, tenant: str, tokens: int,
                 on_release: Callable[[], None] | None = None) -> None:
        self.quotas, self.tenant, self.tokens, self.on_release = quotas, tenant, tokens, on_release
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.quotas._release(self.tenant, self.tokens)
            if self.on_release is not None:
                self.on_release()


async def admit_or_abort(quotas: TenantQuotas, metrics: GatewayMetrics, tenant: str, params: GenerationParams,
                         context: grpc.aio.ServicerContext, telemetry: RequestTelemetry) -> Ticket:
    """The request's ticket, or the call aborted RESOURCE_EXHAUSTED with the retry hint (counted per tenant)."""
    label = quotas.label(tenant)
    ticket = quotas.admit(tenant, len(params.prompt_ids) + params.max_new_tokens)
    if isinstance(ticket, Refusal):
        metrics.tenant_refusals.labels(label, ticket.limit).inc()
        telemetry.fail(grpc.StatusCode.RESOURCE_EXHAUSTED, ticket.message)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, ticket.message, retry_metadata(ticket.retry_after_s))
        raise AssertionError("unreachable: abort raises")
    gauge = metrics.tenant_streams.labels(label)
    gauge.inc()
    ticket.on_release = gauge.dec
    return ticket


class TenantQuotas:
    def __init__(self, limits: dict[str, TenantLimits], default: TenantLimits, retry_after_s: float = 1.0,
                 api_keys: dict[str, str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.default, self.retry_after_s, self.clock = limits, default, retry_after_s, clock
        self.buckets: dict[str, tuple[float, float]] = {}     # tenant -> (tokens in its rate bucket, at clock)
        self.api_keys = api_keys or {}        # key -> tenant, for resolving a call's tenant
        self.named = {t or unbound_key_tenant(k) for k, t in self.api_keys.items()} | set(limits) | {DEFAULT_TENANT}
        self.streams: Counter[str] = Counter()
        self.queued_tokens: Counter[str] = Counter()

    @classmethod
    def from_config(cls, config: GatewayConfig) -> TenantQuotas:
        entries = api_key_entries(config)
        default = TenantLimits(config.tenant_max_streams, config.tenant_max_queued_tokens,
                               config.tenant_tokens_per_s)
        return cls(parse_tenant_limits(entries), default, config.retry_after_s, parse_api_keys(entries))

    def limits_of(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant, self.default)

    def label(self, tenant: str) -> str:
        """The tenant's metric label: its name if configured, else "other"."""
        return tenant if tenant in self.named else "other"

    def admit(self, tenant: str, tokens: int) -> Ticket | Refusal:
        limits = self.limits_of(tenant)
        if limits.max_streams and self.streams[tenant] >= limits.max_streams:
            return Refusal("streams", f"tenant {tenant!r} has {self.streams[tenant]} generations open; its limit is "
                           f"{limits.max_streams} (retry when one ends)", self.retry_after_s)
        if limits.max_queued_tokens and self.queued_tokens[tenant] + tokens > limits.max_queued_tokens:
            return Refusal("tokens", f"tenant {tenant!r} would queue {self.queued_tokens[tenant] + tokens} tokens "
                           f"(prompt + max_new_tokens of its open generations); its limit is "
                           f"{limits.max_queued_tokens}", self.retry_after_s)
        if limits.tokens_per_s:
            refusal = self._take(tenant, tokens, limits.tokens_per_s)
            if refusal is not None:
                return refusal
        self.streams[tenant] += 1
        self.queued_tokens[tenant] += tokens
        return Ticket(self, tenant, tokens)

    def _take(self, tenant: str, tokens: int, rate: int) -> Refusal | None:
        """Takes `tokens` from the tenant's rate bucket (refilled at `rate` per second up to RATE_BURST_S of it)."""
        capacity = rate * RATE_BURST_S
        now = self.clock()
        level, at = self.buckets.get(tenant, (capacity, now))
        level = min(capacity, level + (now - at) * rate)
        if tokens > capacity:
            self.buckets[tenant] = (level, now)
            return Refusal("rate", f"a request of {tokens} tokens (prompt + max_new_tokens) is more than tenant "
                           f"{tenant!r} may start in {RATE_BURST_S:g} s ({rate} tokens/s)", RATE_BURST_S)
        if tokens > level:
            self.buckets[tenant] = (level, now)
            return Refusal("rate", f"tenant {tenant!r} is over its rate of {rate} tokens/s (prompt + "
                           "max_new_tokens of the requests it starts)", (tokens - level) / rate)
        self.buckets[tenant] = (level - tokens, now)
        return None

    def _release(self, tenant: str, tokens: int) -> None:
        self.streams[tenant] -= 1
        self.queued_tokens[tenant] -= tokens
        if self.streams[tenant] <= 0:
            del self.streams[tenant]
            self.queued_tokens.pop(tenant, None)
