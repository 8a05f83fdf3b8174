"""OpenAI-compatible HTTP API of the gateway: /v1/completions, /v1/chat/completions (JSON or server-sent events)
and /v1/models, served with aiohttp in the gateway process on GatewayConfig.http_port.

Every request becomes a call to the gateway's own gRPC Generation service on loopback, so HTTP clients get exactly
the gRPC path: the same validation, API keys (the `Authorization` header is forwarded as metadata), tracing and
metrics. A stream that fails before its first token is answered with an HTTP error; later errors arrive as an
`{"error": ...}` event. A client that disconnects cancels its generation (its KV blocks are released).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

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
from gateway.server import fetch_model_info
from protos.specmesh.v1 import generate_pb2, generate_pb2_grpc, verifier_pb2_grpc
from specmesh.channels import internal_channel
from specmesh.config import GatewayConfig

FORWARDED_HEADERS = ("authorization", "x-specmesh-tenant")
log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int
    created: int


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


@web.middleware
async def _openai_errors(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status)


class OpenAIHttp:
    """The aiohttp app; `grpc_target()` names the gateway's gRPC address (known once the gRPC server is bound)."""

    def __init__(self, model: ServedModel, grpc_target: Callable[[], str],
                 channel_factory: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel) -> None:
        self.model = model
        self._target = grpc_target
        self._channel_factory = channel_factory
        self._channel: grpc.aio.Channel | None = None
        self.app = web.Application(middlewares=[_openai_errors])
        self.app.add_routes([web.get("/v1/models", self.models), web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat_completions)])
        self.runner: web.AppRunner | None = None
        self.port = 0

    def _stub(self) -> generate_pb2_grpc.GenerationStub:
        if self._channel is None:
            self._channel = self._channel_factory(self._target())
        return generate_pb2_grpc.GenerationStub(self._channel)

    async def start(self, host: str, port: int, shutdown_timeout_s: float = 10.0) -> int:
        self.runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=shutdown_timeout_s)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()
        self.port = self.runner.addresses[0][1]
        return self.port

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self._channel is not None:
            await self._channel.close()

    async def models(self, _: web.Request) -> web.Response:
        m = self.model
        return web.json_response({"object": "list", "data": [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": "specmesh",
             "max_model_len": m.max_model_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        parsed = parse_chat(body) if chat else parse_completion(body)
        if parsed.model and parsed.model != self.model.name:
            raise ApiError(404, f"The model `{parsed.model}` does not exist.", param="model",
                           code="model_not_found")
        metadata = tuple((k, request.headers[k]) for k in FORWARDED_HEADERS if k in request.headers)
        if parsed.stream:
            return await self._stream(request, parsed, chat, metadata)
        try:
            reply = await self._stub().Complete(parsed.request, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise ApiError.from_grpc(exc.code(), exc.details() or "") from None
        return web.json_response(completion_object(
            chat, reply.request_id, self.model.name, int(time.time()), reply.text, finish_reason(reply.finish_reason),
            usage_dict(reply.usage)))

    async def _stream(self, request: web.Request, parsed: ParsedRequest, chat: bool,
                      metadata: tuple[tuple[str, str], ...]) -> web.StreamResponse:
        call = self._stub().Generate(parsed.request, metadata=metadata)
        responses = call.__aiter__()
        try:
            first = await anext(responses)           # errors before any output become a plain HTTP error
        except grpc.aio.AioRpcError as exc:
            raise ApiError.from_grpc(exc.code(), exc.details() or "") from None
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            async for event in self._events(first, responses, parsed, chat):
                await response.write(event)
            await response.write(_sse("[DONE]"))
        except grpc.aio.AioRpcError as exc:
            await response.write(_sse(ApiError.from_grpc(exc.code(), exc.details() or "").body()))
        except ConnectionResetError:
            log.info("client left during a stream; generation cancelled")
        finally:
            call.cancel()                                # no-op when finished; frees the KV if the client left
        return response

    async def _events(self, first: generate_pb2.GenerateResponse,
                      rest: AsyncIterator[generate_pb2.GenerateResponse], parsed: ParsedRequest,
                      chat: bool) -> AsyncIterator[bytes]:
        created, sent_any = int(time.time()), False

        async def all_responses() -> AsyncIterator[generate_pb2.GenerateResponse]:
            yield first
            async for r in rest:
                yield r

        async for r in all_responses():
            reason = finish_reason(r.finish_reason)
            if r.text or reason or (chat and not sent_any):
                yield _sse(chunk_object(chat, r.request_id, self.model.name, created, r.text, reason,
                                        first=chat and not sent_any))
                sent_any = True
            if r.HasField("usage") and parsed.include_usage:
                yield _sse(chunk_object(chat, r.request_id, self.model.name, created, None, None,
                                        usage_dict(r.usage)))


async def served_model(config: GatewayConfig, wait_s: float = 600.0) -> ServedModel:
    """The verifier's model, as /v1/models lists it (the name clients pass as `model`)."""
    channel = internal_channel(config.verifier_addr, config.tls)
    try:
        info = await fetch_model_info(verifier_pb2_grpc.VerifierStub(channel), wait_s)
    finally:
        await channel.close()
    return ServedModel(info.model_name, info.max_model_len, int(time.time()))


def loopback_channel_factory(config: GatewayConfig) -> Callable[[str], grpc.aio.Channel]:
    """The channel to the gateway's own gRPC port: plaintext, or TLS with tls_ca (plus the client certificate)."""
    if not config.tls.tls_cert:
        return grpc.aio.insecure_channel
    if not config.tls.tls_ca:
        raise ValueError("http_port with TLS on the gRPC port needs tls_ca (the CA of tls_cert) for the loopback")
    return lambda addr: internal_channel(addr, config.tls)


def loopback_target(host: str, port: int) -> str:
    """Where the gateway's own gRPC server is reachable from inside its process."""
    return f"127.0.0.1:{port}" if host in ("", "0.0.0.0", "::", "[::]") else f"{host}:{port}"


async def start_openai_http(model: ServedModel, host: str, port: int, grpc_target: Callable[[], str],
                            channel_factory: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel
                            ) -> OpenAIHttp:
    http = OpenAIHttp(model, grpc_target, channel_factory)
    await http.start(host, port)
    return http
