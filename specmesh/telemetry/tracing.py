"""OpenTelemetry tracing for a specmesh process, and the gRPC interceptors that propagate W3C trace context.

A process has one TracerProvider (OpenTelemetry allows setting it once). `setup_tracing` installs it from a
service's TelemetryConfig: OTLP/gRPC when `otlp_endpoint` is set, else a JSON-lines file when `trace_file` is set,
else nothing: the API stays a no-op and servers / channels get no interceptors, so tracing off costs nothing.
`add_exporter` is the hook for tests: it adds an exporter (e.g. an InMemorySpanExporter) to the process's
provider, creating it if needed. Either must run before the process builds its servers and channels.
"""

from __future__ import annotations

import uuid
from importlib import metadata
from typing import Any

from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

from specmesh.config import TelemetryConfig
from specmesh.telemetry.span_file import JsonLinesSpanExporter

# GetModelInfo is the gateway's verifier health probe (gateway/health.py, every second) and its start-up fetch; no
# request calls it, so neither the gateway's client span nor the verifier's server span is made for it.
UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/specmesh.v1.Verifier/GetModelInfo")


def _traced(details: Any) -> bool:
    """Health checks, the verifier health probe and reflection are polled constantly and belong to no request: no
    spans for them. (A plain prefix test: the instrumentation's own service filters cost far more per call.)"""
    method = details.method
    if isinstance(method, bytes):
        method = method.decode()
    return not method.startswith(UNTRACED_PREFIXES)


def service_version() -> str:
    try:
        return metadata.version("specmesh")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def service_resource(service: str) -> Resource:
    return Resource.create({"service.name": service, "service.version": service_version(),
                            "service.instance.id": str(uuid.uuid4())})


def make_exporter(config: TelemetryConfig) -> SpanExporter | None:
    if config.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=config.otlp_endpoint,
                                insecure=not config.otlp_endpoint.startswith("https://"))
    if config.trace_file:
        return JsonLinesSpanExporter(config.trace_file)
    return None


def add_exporter(exporter: SpanExporter, service: str, batch: bool = True) -> TracerProvider:
    """Sends this process's spans to `exporter` (batched in the background unless batch=False)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(resource=service_resource(service))
        trace.set_tracer_provider(provider)
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return provider


def setup_tracing(config: TelemetryConfig, service: str) -> TracerProvider | None:
    """Installs the process's tracing from config; None when no export is configured."""
    exporter = make_exporter(config)
    return add_exporter(exporter, service) if exporter is not None else None


def tracing_enabled() -> bool:
    """True once this process has an SDK TracerProvider (setup_tracing / add_exporter ran)."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def server_interceptors() -> list[Any]:
    """Server span per RPC, continuing the caller's trace from the W3C `traceparent` metadata.
    None when tracing is off, so it then costs nothing: set tracing up before building servers."""
    return [aio_server_interceptor(filter_=_traced)] if tracing_enabled() else []


def client_interceptors() -> list[Any]:
    """Client span per RPC; injects `traceparent` into the call's metadata (none when tracing is off)."""
    return list(aio_client_interceptors(filter_=_traced)) if tracing_enabled() else []


def trace_id_hex(span: trace.Span) -> str:
    """The span's trace id as 32 hex digits, or "" when tracing is off."""
    ctx = span.get_span_context()
    return trace.format_trace_id(ctx.trace_id) if ctx.is_valid else ""
