"""Transport security and API keys: gRPC TLS / mutual-TLS credentials from TlsConfig, and the public API's
`authorization: Bearer <key>` check.

A call to the public Generation service without a bearer key gets UNAUTHENTICATED; one with a key that is not
configured gets PERMISSION_DENIED. Health and reflection stay open (orchestrator probes, grpcurl list).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from specmesh.config import GatewayConfig, TlsConfig

PUBLIC_METHOD_PREFIX = "/specmesh.v1.Generation/"


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc.strerror}") from None


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """TLS for a service's port (None = plaintext); client certificates required when tls_client_ca is set."""
    if not tls.tls_cert and not tls.tls_key:
        return None
    if not (tls.tls_cert and tls.tls_key):
        raise ValueError("TLS needs both tls_cert and tls_key")
    pair = [(_read(tls.tls_key, "tls_key"), _read(tls.tls_cert, "tls_cert"))]
    if tls.tls_client_ca:
        return grpc.ssl_server_credentials(pair, root_certificates=_read(tls.tls_client_ca, "tls_client_ca"),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials | None:
    """TLS towards other specmesh services (None = plaintext), with a client certificate for mutual TLS."""
    if not tls.tls_ca:
        return None
    if bool(tls.tls_client_cert) != bool(tls.tls_client_key):
        raise ValueError("mutual TLS needs both tls_client_cert and tls_client_key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.tls_ca, "tls_ca"),
        private_key=_read(tls.tls_client_key, "tls_client_key") if tls.tls_client_key else None,
        certificate_chain=_read(tls.tls_client_cert, "tls_client_cert") if tls.tls_client_cert else None)


def load_api_keys(config: GatewayConfig) -> frozenset[str]:
    keys = [k.strip() for k in config.api_keys.split(",")]
    if config.api_keys_file:
        keys += [line.strip() for line in _read(config.api_keys_file, "api_keys_file").decode().splitlines()]
    return frozenset(k for k in keys if k and not k.startswith("#"))


def _denied(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that fails the call with code."""
    async def unary(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def stream(request: object, context: grpc.aio.ServicerContext):  # noqa: ANN202 (async generator)
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises

    kinds = {"unary_unary": (grpc.unary_unary_rpc_method_handler, unary),
             "unary_stream": (grpc.unary_stream_rpc_method_handler, stream)}
    for kind, (make, fn) in kinds.items():
        if getattr(handler, kind) is not None:
            return make(fn, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    raise TypeError(f"API keys cannot guard a {handler} method")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <key>` on the public API's methods (constant-time comparison)."""

    def __init__(self, keys: frozenset[str], prefix: str = PUBLIC_METHOD_PREFIX) -> None:
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self.keys = keys
        self.prefix = prefix

    def _verdict(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> tuple[grpc.StatusCode, str] | None:
        header = next((str(v) for k, v in metadata or () if k == "authorization"), "")
        scheme, _, key = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return grpc.StatusCode.UNAUTHENTICATED, "missing API key: send metadata 'authorization: Bearer <key>'"
        if not any(hmac.compare_digest(key.strip().encode(), k.encode()) for k in self.keys):
            return grpc.StatusCode.PERMISSION_DENIED, "API key not accepted"
        return None

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        verdict = self._verdict(details.invocation_metadata)
        return handler if verdict is None else _denied(handler, *verdict)


def api_key_interceptors(config: GatewayConfig) -> list[grpc.aio.ServerInterceptor]:
    keys = load_api_keys(config)
    return [ApiKeyInterceptor(keys)] if keys else []
