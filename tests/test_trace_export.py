"""Span export without the stack: OTLP/gRPC reaches a real receiver, the JSON-lines file and Jaeger's query API
both feed the waterfall CLI."""

from __future__ import annotations

import json
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind

from specmesh.config import TelemetryConfig
from specmesh.ops import cli
from specmesh.telemetry.span_file import JsonLinesSpanExporter
from specmesh.telemetry.tracing import make_exporter, service_resource


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP trace collector: counts what it is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.services: list[str] = []

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                self.spans.extend(scope.spans)
                self.services.extend(attrs.get("service.name", "") for _ in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


def make_spans(provider: TracerProvider, idle_forward: bool = False) -> None:
    tracer = provider.get_tracer("test")
    request = tracer.start_span("request", kind=SpanKind.SERVER)
    with trace.use_span(request, end_on_exit=True), tracer.start_as_current_span("round"):
        pass
    with tracer.start_as_current_span("engine forward", links=[Link(request.get_span_context())]):
        pass
    if idle_forward:                  # later roots that are not requests: a step for no caller, a service's own call
        with tracer.start_as_current_span("engine forward"):
            pass
        with tracer.start_as_current_span("GetModelInfo", kind=SpanKind.CLIENT):
            pass


def test_otlp_exporter_sends_to_a_grpc_receiver(receiver) -> None:
    servicer, port = receiver
    exporter = make_exporter(TelemetryConfig(otlp_endpoint=f"http://127.0.0.1:{port}", trace_file="/nonexistent/x"))
    provider = TracerProvider(resource=service_resource("specmesh-gateway"))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    make_spans(provider)
    provider.shutdown()
    assert sorted(s.name for s in servicer.spans) == ["engine forward", "request", "round"]
    assert set(servicer.services) == {"specmesh-gateway"}
    spans = {s.name: s for s in servicer.spans}
    assert spans["round"].parent_span_id == spans["request"].span_id
    assert spans["engine forward"].links[0].span_id == spans["request"].span_id


def test_trace_cli_reads_a_span_file(tmp_path, capsys) -> None:
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider(resource=service_resource("specmesh-verifier"))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(str(path))))
    make_spans(provider, idle_forward=True)
    provider.shutdown()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["service.name"] for r in records} == {"specmesh-verifier"}
    assert cli.main(["trace", "show", "--file", str(path), "--last"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"trace {records[-3]['links'][0]['trace_id']}")
    assert lines[1].startswith("request") and "└─ ⇢ engine forward" in lines[3]


def jaeger_reply(trace_id: str) -> dict[str, Any]:
    def span(span_id: str, name: str, start: int, duration: int, parent: str | None) -> dict[str, Any]:
        refs = [{"refType": "CHILD_OF", "traceID": trace_id, "spanID": parent}] if parent else []
        return {"traceID": trace_id, "spanID": span_id, "operationName": name, "references": refs,
                "startTime": start, "duration": duration, "processID": "p1",
                "tags": [{"key": "span.kind", "type": "string", "value": "server"}]}
    return {"data": [{"traceID": trace_id, "processes": {"p1": {"serviceName": "specmesh-gateway"}},
                      "spans": [span("a" * 16, "/specmesh.v1.Generation/Generate", 1_000, 9_000, None),
                                span("b" * 16, "round", 2_000, 3_000, "a" * 16)]}]}


def test_trace_cli_reads_jaeger(capsys) -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            seen.append(self.path)
            body = json.dumps(jaeger_reply(trace_id)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert cli.main(["trace", "show", "--jaeger", url, "--trace-id", trace_id]) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [f"/api/traces/{trace_id}"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"trace {trace_id}") and "9.00 ms" in lines[0]
    assert lines[1].startswith("/specmesh.v1.Generation/Generate") and "specmesh-gateway" in lines[1]
    assert lines[2].startswith("└─ round") and "3.00 ms" in lines[2]
