"""One place where every service parses its requests and maps errors to gRPC status codes.

`RpcGuard` is a server interceptor that wraps every unary-request method of a server (verifier, draft service,
gateway, and health), so servicers only validate, delegate and raise:

- request bytes that do not parse (truncated, wrong wire type, a string that is not UTF-8) never fail inside gRPC
  (which answers INTERNAL or UNKNOWN): the parser returns an `UndecodableRequest` marker and the call is answered
  INVALID_ARGUMENT naming the message type;
- an `EngineError` raised by a servicer (or by the engine it awaits) becomes its status code with its message;
- any other exception becomes INTERNAL with its traceback logged, never UNKNOWN.

Methods with a request stream (server reflection) pass through unchanged.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from specmesh.engine.errors import EngineError

log = logging.getLogger(__name__)

Deserializer = Callable[[bytes], Any]
Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]
# Told of a call refused before its servicer ran (method, status): the gateway counts these in its error metric.
RefusalHook = Callable[[str, grpc.StatusCode], None]


@dataclass(frozen=True)
class UndecodableRequest:
    """What a method receives instead of a message when its request bytes do not parse."""
    message_type: str        # e.g. "specmesh.v1.VerifyRequest"
    reason: str


def status_code(name: str) -> grpc.StatusCode:
    """The gRPC status of an EngineError code name (unknown names: INTERNAL)."""
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)


def safe_deserializer(deserializer: Deserializer | None) -> Deserializer | None:
    """`deserializer`, returning an UndecodableRequest marker where it would raise."""
    if deserializer is None:
        return None
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    message_type = descriptor.full_name if descriptor is not None else getattr(deserializer, "__name__", "request")

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return UndecodableRequest(message_type, str(exc) or type(exc).__name__)
    return parse


async def _abort_for(exc: Exception, method: str, context: grpc.aio.ServicerContext) -> None:
    """Answers the call for an exception a method raised (always raises AbortError)."""
    if isinstance(exc, EngineError):
        await context.abort(status_code(exc.code), str(exc))
    log.error("%s failed", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the service log")


async def _reject_undecodable(request: Any, context: grpc.aio.ServicerContext, method: str,
                              on_refused: RefusalHook | None) -> None:
    if isinstance(request, UndecodableRequest):
        if on_refused is not None:
            on_refused(method, grpc.StatusCode.INVALID_ARGUMENT)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request is not a valid {request.message_type}: {request.reason}")


def guard_unary(behavior: Behavior, method: str, on_refused: RefusalHook | None = None
                ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _reject_undecodable(request, context, method, on_refused)
        try:
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never UNKNOWN
            await _abort_for(exc, method, context)
    return unary


def guard_stream(behavior: Behavior, method: str, on_refused: RefusalHook | None = None
                 ) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _reject_undecodable(request, context, method, on_refused)
        try:
            result = behavior(request, context)
            if inspect.isasyncgen(result):
                async for item in result:
                    yield item
            elif inspect.isawaitable(result):      # a method that writes with context.write()
                await result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never UNKNOWN
            await _abort_for(exc, method, context)
    return stream


def guard_handler(handler: grpc.RpcMethodHandler, method: str,
                  on_refused: RefusalHook | None = None) -> grpc.RpcMethodHandler:
    """The same method with a safe parser and error mapping (methods with a request stream: unchanged)."""
    parse = safe_deserializer(handler.request_deserializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(guard_unary(handler.unary_unary, method, on_refused), parse,
                                                   handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(guard_stream(handler.unary_stream, method, on_refused), parse,
                                                    handler.response_serializer)
    return handler


class RpcGuard(grpc.aio.ServerInterceptor):
    """Installed innermost on every ServiceServer (specmesh/rpc/grpc_server.py): see the module docstring.

    on_refused: told of each call refused as undecodable (its servicer never runs, so it cannot count it)."""

    def __init__(self, on_refused: RefusalHook | None = None) -> None:
        self.on_refused = on_refused

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        return handler if handler is None else guard_handler(handler, details.method, self.on_refused)
