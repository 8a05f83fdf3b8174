"""Observability shared by the services: OpenTelemetry tracing, Prometheus metrics, trace inspection.

- `tracing`: one TracerProvider per process (service.name / version / instance id), OTLP or JSON-lines export,
  the gRPC interceptors that carry W3C trace context on every call.
- `span_file`: the JSON-lines span exporter (one JSON object per span).
- `metrics`: the Prometheus metric families of the gateway and of the model engines, and the /metrics endpoint.
- `engine_step`: the span and metrics of one batched engine forward (linked to every request it served).
- `trace_store` / `waterfall`: read spans back (file or Jaeger) and print a request's span tree.

Configuration (TelemetryConfig of each service; SERVICE is GATEWAY, VERIFIER or DRAFT):
  SPECMESH_<SERVICE>_OTLP_ENDPOINT   OTLP/gRPC collector or Jaeger, e.g. http://jaeger:4317 (https:// = TLS)
  SPECMESH_<SERVICE>_TRACE_FILE      JSON-lines span file used when no OTLP endpoint is set (may be shared)
  SPECMESH_<SERVICE>_METRICS_PORT    Prometheus /metrics port on the service's host (0 = off)
With neither an endpoint nor a file, tracing is off (spans are not recorded; request ids are random).
The SDK's own OTEL_* variables (e.g. OTEL_EXPORTER_OTLP_HEADERS, OTEL_BSP_SCHEDULE_DELAY) still apply.
"""
