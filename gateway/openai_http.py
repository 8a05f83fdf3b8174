"""OpenAI-compatible HTTP API of the gateway: /v1/completions, /v1/chat/completions (JSON or server-sent events),
/v1/models and /v1/tokenize (vLLM's shape), plus /health, /ping, /metrics and /version, served with aiohttp in the
gateway process on GatewayConfig.http_port (HTTPS when the gateway has a TLS certificate).

Every generation becomes a call to the gateway's own gRPC Generation service on loopback, so HTTP clients get
exactly the gRPC path: the same validation, API keys (the `Authorization` header is forwarded as metadata),
tracing and request / latency / token / error metrics. Refusals made before that call (bad JSON, wrong types,
unknown routes, ...) are answered in OpenAI's error shape by gateway/http_edge.py and counted in the same error
metric. A stream that fails before its first token is answered with an HTTP error; later errors arrive as an
`{"error": ...}` event. A client that disconnects cancels its generation (its KV blocks are released).
/health (and /ping) read the gateway's gRPC health, which follows whether a verifier replica answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from transformers import PreTrainedTokenizerBase

import specmesh
from gateway.channels import internal_channel
from gateway.http_edge import Handler, error_middleware, forwarded_metadata, json_object
from gateway.openai_protocol import (
    ApiError,
    ParsedRequest,
    chunk_object,
    completion_object,
    finish_reason,
    parse_chat,
    parse_completion,
    usage_dict,
)
from gateway.quotas import retry_after_header
from protos.specmesh.v1 import generate_pb2, generate_pb2_grpc
from specmesh.config import GatewayConfig, InputLimits
from specmesh.engine.errors import EngineError
from specmesh.rpc.grpc_server import ServiceServer
from specmesh.rpc.limits import check_messages, check_prompt, field_of
from specmesh.rpc.security import TENANT_HEADER, ApiKeys, Denied, resolve_tenant
from specmesh.telemetry.metrics import GatewayMetrics

FORWARDED_HEADERS = ("authorization", TENANT_HEADER)
log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 2.0

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int
    created: int


def relayed_error(exc: grpc.aio.AioRpcError) -> ApiError:
    """The HTTP error of the gRPC service's answer, with Retry-After when it carried a retry hint (overload)."""
    error = ApiError.from_grpc(exc.code(), exc.details() or "")
    error.headers.update(retry_after_header(exc.trailing_metadata()))
    return error


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class OpenAIHttp:
    """The aiohttp app; `grpc_target()` names the gateway's gRPC address (known once the gRPC server is bound).
    `metrics`: the gateway's (HTTP refusals counted, /metrics served); `tokenizer`: for /v1/tokenize;
    `ssl_context`: HTTPS (gateway.http_edge.http_ssl_context); `api_keys`: the gateway's, checked on every /v1/
    route with the gRPC API's rule (specmesh.rpc.security.resolve_tenant; the gRPC service checks generations again);
    `limits`: the body cap, and the prompt / messages caps of /v1/tokenize (generations: the gRPC service's)."""

    def __init__(self, model: ServedModel, grpc_target: Callable[[], str],
                 channel_factory: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel,
                 metrics: GatewayMetrics | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 ssl_context: ssl.SSLContext | None = None, api_keys: ApiKeys | None = None,
                 limits: InputLimits | None = None) -> None:
        self.model = model
        self.limits = limits or InputLimits()
        self._tokenizing = asyncio.Semaphore(self.limits.max_concurrent_tokenize)    # bounds the RSS of a flood
        self._target = grpc_target
        self._channel_factory = channel_factory
        self._channel: grpc.aio.Channel | None = None
        self.metrics, self.tokenizer, self.ssl_context, self.api_keys = metrics, tokenizer, ssl_context, api_keys
        self.app = web.Application(middlewares=[error_middleware(metrics, self.limits.max_body_bytes),
                                                self._check_api_key], client_max_size=self.limits.max_body_bytes)
        self.app.add_routes([
            web.get("/v1/models", self.models), web.get("/v1/models/{model}", self.model_card),
            web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/tokenize", self.tokenize), web.get("/health", self.health), web.get("/ping", self.health),
            web.post("/ping", self.health), web.get("/metrics", self.prometheus), web.get("/version", self.version)])
        self.runner: web.AppRunner | None = None
        self.port = 0

    @web.middleware
    async def _check_api_key(self, request: web.Request,
                             handler: Handler) -> web.StreamResponse:
        if self.api_keys is not None and request.path.startswith("/v1/"):
            verdict = resolve_tenant(self.api_keys, request.headers.get("Authorization"),
                                     request.headers.get(TENANT_HEADER))
            if isinstance(verdict, Denied):
                raise ApiError.from_grpc(verdict.code, verdict.message, relayed=False)
        return await handler(request)

    def _grpc_channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = self._channel_factory(self._target())
        return self._channel

    def _stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(self._grpc_channel())

    async def start(self, host: str, port: int, shutdown_timeout_s: float = 10.0) -> int:
        self.runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=shutdown_timeout_s)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port, ssl_context=self.ssl_context).start()
        self.port = self.runner.addresses[0][1]
        return self.port

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self._channel is not None:
            await self._channel.close()

    def _card(self) -> dict[str, Any]:
        m = self.model
        return {"id": m.name, "object": "model", "created": m.created, "owned_by": "specmesh",
                "root": m.name, "parent": None, "max_model_len": m.max_model_len}

    def _check_model(self, name: str) -> None:
        if name and name != self.model.name:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return web.json_response(self._card())

    async def health(self, _: web.Request) -> web.Response:
        """200 while the gateway can serve (its gRPC health is SERVING: a verifier replica answers), else 503."""
        try:
            reply = await health_pb2_grpc.HealthStub(self._grpc_channel()).Check(
                health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as exc:
            status = f"gateway gRPC port: {exc.code().name}"
        if status == "SERVING":
            return web.json_response({"status": "ok", "model": self.model.name})
        reason = "no verifier replica answers" if status == "NOT_SERVING" else status
        error = ApiError(503, f"the gateway cannot serve: {reason}", "server_error", code="service_unavailable")
        return web.json_response({"status": "unavailable", **error.body()}, status=503)

    async def prometheus(self, _: web.Request) -> web.Response:
        if self.metrics is None:
            raise ApiError(404, "metrics are not wired into this HTTP API")
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": specmesh.__version__, "models": [self.model.name]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `prompt` (special tokens added unless add_special_tokens is false) or chat `messages`
        (the chat template with the generation prompt, as the gateway renders them)."""
        if self.tokenizer is None:
            raise ApiError(404, "tokenize is not available on this HTTP API")
        body = await json_object(request)
        model = body.get("model")
        self._check_model(model if isinstance(model, str) else "")
        add_special = body.get("add_special_tokens")
        if add_special is not None and not isinstance(add_special, bool):
            raise ApiError(400, "'add_special_tokens' must be of type bool", param="add_special_tokens")
        tokenizer = self.tokenizer
        if "messages" in body:
            chat = parse_chat({"messages": body["messages"]}).request.messages
            messages = [{"role": m.role, "content": m.content} for m in chat]
            self._capped(check_messages, [m["content"] for m in messages])
            if getattr(tokenizer, "chat_template", None) is None:
                raise ApiError(400, "the model has no chat template; send a prompt", param="messages")
            async with self._tokenizing:
                text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, tokenize=False,
                                               add_generation_prompt=True)
            add_special = bool(add_special)
        else:
            text = parse_completion({"prompt": body.get("prompt")}).request.prompt
            self._capped(check_prompt, text)
            add_special = True if add_special is None else add_special
        async with self._tokenizing:
            encoded = await asyncio.to_thread(tokenizer, text, add_special_tokens=add_special)
        tokens = list(encoded["input_ids"])
        return web.json_response({"count": len(tokens), "max_model_len": self.model.max_model_len,
                                  "tokens": tokens, "token_strs": None})

    def _capped(self, check: Callable[[Any, InputLimits], None], value: Any) -> None:
        """A cap of specmesh.config.InputLimits as a 400 naming the field."""
        try:
            check(value, self.limits)
        except EngineError as exc:
            raise ApiError(400, str(exc), param=field_of(exc)) from None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await json_object(request)
        parsed = parse_chat(body) if chat else parse_completion(body)
        self._check_model(parsed.model)
        metadata = forwarded_metadata(request, FORWARDED_HEADERS)
        if parsed.stream:
            return await self._stream(request, parsed, chat, metadata)
        try:
            reply = await self._stub().Complete(parsed.request, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise relayed_error(exc) from None
        return web.json_response(completion_object(
            chat, reply.request_id, self.model.name, int(time.time()), reply.text, finish_reason(reply.finish_reason),
            usage_dict(reply.usage)))

    async def _stream(self, request: web.Request, parsed: ParsedRequest, chat: bool,
                      metadata: tuple[tuple[str, str], ...]) -> web.StreamResponse:
        prompt_tokens = await self._prompt_tokens(parsed.request) if parsed.continuous_usage else 0
        call = self._stub().Generate(parsed.request, metadata=metadata)
        responses = call.__aiter__()
        try:
            first = await anext(responses)           # errors before any output become a plain HTTP error
        except grpc.aio.AioRpcError as exc:
            raise relayed_error(exc) from None
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            async for event in self._events(first, responses, parsed, chat, prompt_tokens):
                await response.write(event)
            await response.write(_sse("[DONE]"))
        except grpc.aio.AioRpcError as exc:
            await response.write(_sse(ApiError.from_grpc(exc.code(), exc.details() or "").body()))
        except ConnectionResetError:
            log.info("client left during a stream; generation cancelled")
        except Exception:                            # a bug once the headers went out: an error event, logged
            log.exception("unexpected error during a stream")
            if self.metrics is not None:
                self.metrics.errors.labels("INTERNAL").inc()
            with contextlib.suppress(ConnectionResetError):
                await response.write(_sse(ApiError(500, "internal error (logged by the gateway)", "server_error",
                                                   code="internal_error").body()))
        finally:
            call.cancel()                                # no-op when finished; frees the KV if the client left
        return response

    async def _events(self, first: generate_pb2.GenerateResponse,
                      rest: AsyncIterator[generate_pb2.GenerateResponse], parsed: ParsedRequest,
                      chat: bool, prompt_tokens: int = 0) -> AsyncIterator[bytes]:
        created, sent_any = int(time.time()), False

        async def all_responses() -> AsyncIterator[generate_pb2.GenerateResponse]:
            yield first
            async for r in rest:
                yield r

        completion_tokens = 0
        async for r in all_responses():
            reason = finish_reason(r.finish_reason)
            completion_tokens += len(r.token_ids)
            if r.text or reason or (chat and not sent_any):
                so_far = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens} if parsed.continuous_usage else None
                yield _sse(chunk_object(chat, r.request_id, self.model.name, created, r.text, reason, so_far,
                                        first=chat and not sent_any))
                sent_any = True
            if r.HasField("usage") and parsed.include_usage:
                yield _sse(chunk_object(chat, r.request_id, self.model.name, created, None, None,
                                        usage_dict(r.usage)))


    async def _prompt_tokens(self, request: generate_pb2.GenerateRequest) -> int:
        """The prompt's token count as the gateway's validation tokenizes it (the final usage says the same)."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ApiError(400, "'stream_options.continuous_usage_stats' needs the tokenizer on this HTTP API",
                           param="stream_options.continuous_usage_stats")
        if not request.messages:
            return len((await asyncio.to_thread(tokenizer, request.prompt))["input_ids"])
        chat = [{"role": m.role, "content": m.content} for m in request.messages]
        text = await asyncio.to_thread(tokenizer.apply_chat_template, chat, tokenize=False, add_generation_prompt=True)
        return len((await asyncio.to_thread(tokenizer, text, add_special_tokens=False))["input_ids"])


def add_loopback_port(server: ServiceServer) -> str:
    """A plaintext Unix-socket port of the gateway's gRPC server for its own HTTP API, in a new directory only this
    user may enter. The HTTP API then needs no client certificate that the public port would accept (with
    tls_client_ca the public port takes only end-user certificates); API keys and everything else still apply.
    Call before the server starts; returns the target for the HTTP API's channel."""
    directory = tempfile.mkdtemp(prefix="specmesh-gateway-")          # mode 0700
    target = f"unix:{directory}/grpc.sock"
    if server.server.add_insecure_port(target) == 0:
        raise RuntimeError(f"cannot bind the HTTP API's loopback {target}")

    async def remove() -> None:
        shutil.rmtree(directory, ignore_errors=True)

    server.on_stop.append(remove)
    return target


def loopback_channel_factory(config: GatewayConfig) -> Callable[[str], grpc.aio.Channel]:
    """The channel to the gateway's own gRPC port: plaintext, or TLS with tls_ca (plus the client certificate)."""
    if not config.tls.tls_cert:
        plaintext: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel
        return plaintext
    if not config.tls.tls_ca:
        raise ValueError("http_port with TLS on the gRPC port needs tls_ca (the CA of tls_cert) for the loopback")
    return lambda addr: internal_channel(addr, config.tls)


async def start_openai_http(model: ServedModel, host: str, port: int, grpc_target: Callable[[], str],
                            channel_factory: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel,
                            metrics: GatewayMetrics | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                            ssl_context: ssl.SSLContext | None = None, api_keys: ApiKeys | None = None,
                            limits: InputLimits | None = None) -> OpenAIHttp:
    http = OpenAIHttp(model, grpc_target, channel_factory, metrics, tokenizer, ssl_context, api_keys, limits)
    await http.start(host, port)
    return http
