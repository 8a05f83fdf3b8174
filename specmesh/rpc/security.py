"""Transport security, peer identity, API keys and tenants.

- gRPC TLS / mutual-TLS credentials from TlsConfig; on the internal services, `tls_allowed_peers` names the client
  certificates (CN or SAN) that may call them (PeerIdentityInterceptor), so an end-user certificate is refused.
- The public API's `authorization: Bearer <key>`: no bearer key -> UNAUTHENTICATED, a key that is not configured ->
  PERMISSION_DENIED.
- Tenants (the draft cache's scope): `resolve_tenant` is the one rule, shared by the gRPC API and the HTTP API. A key
  entry `KEY:TENANT` binds the key to TENANT; a plain `KEY` gets a tenant of its own, `key-` + 16 hex digits of
  SHA-256(KEY). With keys configured an `x-specmesh-tenant` header may only repeat the key's tenant (anything else
  is PERMISSION_DENIED); without keys the header names the tenant ("default" when absent).
Health and reflection stay open (orchestrator probes, grpcurl list).
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from specmesh.config import GatewayConfig, TlsConfig
from specmesh.rpc.rpc_guard import RefusalHook

PUBLIC_METHOD_PREFIX = "/specmesh.v1.Generation/"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
TENANT_HEADER = "x-specmesh-tenant"
DEFAULT_TENANT = "default"
PEER_NAME_PROPERTIES = ("x509_common_name", "x509_subject_alternative_name")

Metadata = Iterable[tuple[str, str | bytes]] | None
ApiKeys = Mapping[str, str]            # key -> the tenant it is bound to ("" = none: its own hashed tenant)


@dataclass(frozen=True)
class Denied:
    """Why a call is refused: a status code and a message that names no secret."""

    code: grpc.StatusCode
    message: str


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc.strerror}") from None


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """TLS for a service's port (None = plaintext); client certificates required when tls_client_ca is set."""
    if tls.tls_allowed_peers.strip() and not (tls.tls_cert and tls.tls_client_ca):
        raise ValueError("tls_allowed_peers needs mutual TLS: set tls_cert, tls_key and tls_client_ca")
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


def api_key_entries(config: GatewayConfig) -> list[str]:
    """The configured entries: `api_keys` (comma-separated), then the lines of `api_keys_file`."""
    entries = config.api_keys.split(",")
    if config.api_keys_file:
        entries += _read(config.api_keys_file, "api_keys_file").decode().splitlines()
    return entries


def split_entry(entry: str) -> tuple[str, str, str] | None:
    """`KEY[:TENANT[:LIMITS]]` -> (key, tenant, limits), stripped; None for a blank or `#` line."""
    entry = entry.strip()
    if not entry or entry.startswith("#"):
        return None
    parts = [part.strip() for part in entry.split(":", 2)]
    return parts[0], parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else ""


def parse_api_keys(entries: Iterable[str]) -> dict[str, str]:
    """`KEY`, `KEY:TENANT` or `KEY:TENANT:LIMITS` entries (blank and `#` lines skipped) -> {key: tenant or ""}.
    Keys cannot hold ':'. The limits (gateway/quotas.py) are the tenant's, parsed there."""
    keys: dict[str, str] = {}
    for number, entry in enumerate(entries, 1):
        parts = split_entry(entry)
        if parts is None:
            continue
        key, tenant, _ = parts
        if not key or (":" in entry and not tenant):
            raise ValueError(f"API key entry {number}: expected KEY, KEY:TENANT or KEY:TENANT:LIMITS")
        if keys.get(key, tenant) != tenant:
            raise ValueError(f"API key entry {number}: the key is already bound to another tenant")
        keys[key] = tenant
    return keys


def load_api_keys(config: GatewayConfig) -> dict[str, str]:
    return parse_api_keys(api_key_entries(config))


def unbound_key_tenant(key: str) -> str:
    """The tenant of a key configured without one: private to that key, and not the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def metadata_value(metadata: Metadata, name: str) -> str | None:
    for key, value in metadata or ():
        if key.lower() == name:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


def _matching_key(keys: ApiKeys, presented: str) -> str | None:
    """The configured key equal to presented; compares against every key in constant time."""
    found = None
    for key in keys:
        if hmac.compare_digest(presented.encode(), key.encode()):
            found = key
    return found


def resolve_tenant(keys: ApiKeys, authorization: str | None, tenant_header: str | None) -> str | Denied:
    """The caller's tenant, or why the call is refused (see the module docstring for the rule)."""
    header = (tenant_header or "").strip()
    if not keys:
        return header or DEFAULT_TENANT
    scheme, _, presented = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return Denied(grpc.StatusCode.UNAUTHENTICATED, "missing API key: send metadata 'authorization: Bearer <key>'")
    key = _matching_key(keys, presented.strip())
    if key is None:
        return Denied(grpc.StatusCode.PERMISSION_DENIED, "API key not accepted")
    tenant = keys[key] or unbound_key_tenant(key)
    if header and header != tenant:
        return Denied(grpc.StatusCode.PERMISSION_DENIED, f"this API key may not act for tenant {header!r}")
    return tenant


def tenant_of(keys: ApiKeys, metadata: Metadata) -> str | Denied:
    return resolve_tenant(keys, metadata_value(metadata, "authorization"), metadata_value(metadata, TENANT_HEADER))


def _denied(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that fails the call with code."""
    async def unary(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def stream(request: object, context: grpc.aio.ServicerContext):  # noqa: ANN202 (async generator)
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises

    return _same_shape(handler, unary, stream)


def _same_shape(handler: grpc.RpcMethodHandler, unary: Callable, stream: Callable) -> grpc.RpcMethodHandler:
    kinds = {"unary_unary": (grpc.unary_unary_rpc_method_handler, unary),
             "unary_stream": (grpc.unary_stream_rpc_method_handler, stream)}
    for kind, (make, fn) in kinds.items():
        if getattr(handler, kind) is not None:
            return make(fn, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    raise TypeError(f"cannot guard a {handler} method")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <key>` and the tenant header on the public API's methods (`resolve_tenant`)."""

    def __init__(self, keys: ApiKeys, prefix: str = PUBLIC_METHOD_PREFIX,
                 on_refused: RefusalHook | None = None) -> None:
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self.keys = keys
        self.prefix = prefix
        self.on_refused = on_refused             # told of each refusal (the gateway's error metric)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        verdict = tenant_of(self.keys, details.invocation_metadata)
        if not isinstance(verdict, Denied):
            return handler
        if self.on_refused is not None:
            self.on_refused(details.method, verdict.code)
        return _denied(handler, verdict.code, verdict.message)


def api_key_interceptors(keys: ApiKeys, on_refused: RefusalHook | None = None) -> list[grpc.aio.ServerInterceptor]:
    return [ApiKeyInterceptor(keys, on_refused=on_refused)] if keys else []


def parse_peer_names(text: str) -> frozenset[str]:
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def peer_names(auth_context: Mapping[str, Iterable[bytes]]) -> set[str]:
    """The CN and SAN names of the verified client certificate (empty without mutual TLS)."""
    return {value.decode(errors="replace") for prop in PEER_NAME_PROPERTIES for value in auth_context.get(prop, ())}


class PeerIdentityInterceptor(grpc.aio.ServerInterceptor):
    """Lets only callers whose client certificate names one of `allowed` (CN or SAN) reach the service's methods;
    others get PERMISSION_DENIED. Health and reflection stay open. Needs mutual TLS (tls_client_ca)."""

    def __init__(self, allowed: frozenset[str]) -> None:
        if not allowed:
            raise ValueError("PeerIdentityInterceptor needs at least one allowed name")
        self.allowed = allowed

    def _check(self, context: grpc.aio.ServicerContext) -> Denied | None:
        if peer_names(context.auth_context()) & self.allowed:
            return None
        return Denied(grpc.StatusCode.PERMISSION_DENIED, "this client certificate may not call this service")

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        return self._guarded(handler)

    def _guarded(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        async def unary(request: object, context: grpc.aio.ServicerContext) -> object:
            if denied := self._check(context):
                await context.abort(denied.code, denied.message)
            result = handler.unary_unary(request, context)
            return await result if inspect.isawaitable(result) else result

        async def stream(request: object, context: grpc.aio.ServicerContext):  # noqa: ANN202 (async generator)
            if denied := self._check(context):
                await context.abort(denied.code, denied.message)
            async for response in handler.unary_stream(request, context):
                yield response

        return _same_shape(handler, unary, stream)


def peer_interceptors(tls: TlsConfig) -> list[grpc.aio.ServerInterceptor]:
    """The peer-identity check when `tls_allowed_peers` is set (which needs mutual TLS)."""
    allowed = parse_peer_names(tls.tls_allowed_peers)
    if not allowed:
        return []
    server_credentials(tls)                           # refuses allowed peers without mutual TLS
    return [PeerIdentityInterceptor(allowed)]
