"""The request span (GenAI semantic conventions) and the gateway's per-request metrics.

The span is created here but never made current across the stream's yields (a cancelled stream would detach a
context in the wrong place); instead `context` is handed to the Generation, whose round spans use it as parent.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from gateway.validation import GenerationParams
from protos.specmesh.v1 import common_pb2, generate_pb2
from specmesh.telemetry.metrics import GatewayMetrics
from specmesh.telemetry.tracing import trace_id_hex

_tracer = trace.get_tracer("specmesh.gateway")
OPERATION = "text_completion"


def finish_reason_name(reason: int) -> str:
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def draft_source_name(source: int) -> str:
    return common_pb2.DraftSource.Name(source).removeprefix("DRAFT_SOURCE_").lower()


def _error_code(exc: BaseException | None) -> grpc.StatusCode:
    if exc is None or isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


class RequestTelemetry:
    def __init__(self, metrics: GatewayMetrics, model: str) -> None:
        self.metrics = metrics
        self.span = _tracer.start_span(f"{OPERATION} {model}", attributes={
            "gen_ai.operation.name": OPERATION, "gen_ai.provider.name": "specmesh", "gen_ai.request.model": model,
            "gen_ai.response.model": model})
        self.context: otel_context.Context = trace.set_span_in_context(self.span)
        self.default_request_id = trace_id_hex(self.span) or uuid.uuid4().hex
        self._start = time.perf_counter()
        self._last_token_at: float | None = None
        self._succeeded = False
        self._ended = False

    def started(self, params: GenerationParams) -> None:
        s = params.sampling
        self.span.set_attributes({
            "gen_ai.response.id": params.request_id, "gen_ai.request.max_tokens": params.max_new_tokens,
            "gen_ai.request.temperature": s.temperature, "gen_ai.request.top_p": s.top_p,
            "gen_ai.request.top_k": s.top_k, "specmesh.request.num_draft_tokens": params.num_draft_tokens})
        if s.seed is not None:
            self.span.set_attribute("gen_ai.request.seed", s.seed)
        if s.min_p > 0:
            self.span.set_attribute("specmesh.request.min_p", s.min_p)
        if s.repetition_penalty != 1.0:
            self.span.set_attribute("specmesh.request.repetition_penalty", s.repetition_penalty)
        if s.logit_bias:
            self.span.set_attribute("specmesh.request.num_logit_bias", len(s.logit_bias))
        self.metrics.prompt_tokens.inc(len(params.prompt_ids))

    def on_response(self, response: generate_pb2.GenerateResponse) -> None:
        now = time.perf_counter()
        n = len(response.token_ids)
        if n:
            if self._last_token_at is None:
                self.metrics.ttft.observe(now - self._start)
                self.span.set_attribute("gen_ai.response.time_to_first_chunk", now - self._start)
            else:
                for _ in range(n):
                    self.metrics.itl.observe((now - self._last_token_at) / n)
            self._last_token_at = now
            self.metrics.generation_tokens.inc(n)
        if response.round.round > 0:
            r = response.round
            self.metrics.observe_round(r.num_drafted, r.num_accepted, draft_source_name(r.draft_source))
        if response.HasField("usage"):
            self._finished(response.finish_reason, response.usage)

    def _finished(self, reason: int, usage: generate_pb2.Usage) -> None:
        name = finish_reason_name(reason)
        self.span.set_attributes({
            "gen_ai.usage.input_tokens": usage.prompt_tokens, "gen_ai.usage.output_tokens": usage.completion_tokens,
            "gen_ai.response.finish_reasons": [name], "specmesh.usage.num_rounds": usage.num_rounds,
            "specmesh.usage.num_drafted_tokens": usage.num_drafted_tokens,
            "specmesh.usage.num_accepted_tokens": usage.num_accepted_tokens,
            "specmesh.usage.acceptance_rate": usage.acceptance_rate})
        self.metrics.requests.labels(name).inc()
        self.metrics.e2e.observe(time.perf_counter() - self._start)
        if usage.num_drafted_tokens:
            self.metrics.acceptance.observe(usage.acceptance_rate)
        self._succeeded = True

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """A request that ends with an error status (counted, and the span marked ERROR)."""
        if self._ended:
            return
        self.metrics.errors.labels(code.name).inc()
        self.span.set_attribute("rpc.grpc.status_code", code.value[0])
        self.span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
        self._close()

    def end(self, exc: BaseException | None = None) -> None:
        """The stream is over: a request that neither finished nor failed was cancelled (or hit a bug: `exc`)."""
        if self._ended:
            return
        if self._succeeded:
            self._close()
            return
        code = _error_code(exc)
        if code != grpc.StatusCode.CANCELLED and exc is not None:
            self.span.record_exception(exc)
        self.fail(code, "the client went away" if code == grpc.StatusCode.CANCELLED else str(exc))

    def _close(self) -> None:
        self._ended = True
        self.span.end()
