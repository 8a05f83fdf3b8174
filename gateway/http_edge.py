"""The HTTP API's edge: every error as OpenAI's JSON body (never text/plain, never a bare 500), JSON body parsing
that refuses what the parser or protobuf cannot take, HTTP refusals counted in the gateway's error metrics, and
the TLS context of the HTTP port (the gRPC port's certificate and key)."""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.openai_protocol import ApiError
from specmesh.config import InputLimits, TlsConfig
from specmesh.telemetry.metrics import GatewayMetrics

log = logging.getLogger(__name__)

MAX_BODY_BYTES = InputLimits().max_body_bytes   # the default cap (InputLimits.max_body_bytes); larger: 413
JSON_CONTENT_TYPES = ("application/json", "")     # no Content-Type at all is taken as JSON (curl -d, some tools)
# HTTP statuses of refusals made by the HTTP layer -> the gRPC code label they are counted under
# (specmesh_request_errors_total{code=...}, the same labels as the gRPC API's refusals)
GRPC_CODE_OF_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                       405: "UNIMPLEMENTED", 413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT",
                       429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def grpc_code_label(status: int) -> str:
    return GRPC_CODE_OF_STATUS.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT")


def _api_error_of(exc: web.HTTPException, request: web.Request, max_body_bytes: int) -> ApiError:
    """aiohttp's own refusals, worded as OpenAI words them."""
    message = exc.reason
    if exc.status == 404:
        message = (f"Invalid URL ({request.method} {request.path}); routes: /v1/models, /v1/completions, "
                   "/v1/chat/completions, /v1/tokenize, /health, /ping, /metrics, /version")
    elif isinstance(exc, web.HTTPMethodNotAllowed):
        message = f"{exc.method} is not allowed on {request.path}; allowed: {', '.join(sorted(exc.allowed_methods))}"
    elif exc.status == 413:
        message = (f"the request body is larger than the limit of {max_body_bytes} bytes "
                   "(SPECMESH_GATEWAY_MAX_BODY_BYTES)")
    return ApiError(exc.status, message, code=exc.reason.lower().replace(" ", "_"))


def error_middleware(metrics: GatewayMetrics | None, max_body_bytes: int = MAX_BODY_BYTES) -> Middleware:
    """Turns ApiError, aiohttp's HTTP errors (404, 405, 413, ...) and any unexpected exception into OpenAI's
    `{"error": {...}}` JSON; counts the refusals the HTTP layer made itself (the gRPC service counts its own)."""

    @web.middleware
    async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            error = exc
        except web.HTTPException as exc:
            if exc.status < 400:                   # redirects and the like pass through
                raise
            error = _api_error_of(exc, request, max_body_bytes)
        except ConnectionResetError:               # the client left (a load generator's cancel): no one to answer
            log.debug("client left during %s %s", request.method, request.path)
            raise                                  # aiohttp ignores a premature disconnection
        except Exception:                          # a bug: logged with its traceback, answered as JSON
            log.exception("unexpected error answering %s %s", request.method, request.path)
            error = ApiError(500, "internal error (logged by the gateway)", "server_error", code="internal_error")
        if metrics is not None and not error.relayed:
            metrics.errors.labels(grpc_code_label(error.status)).inc()
        return web.json_response(error.body(), status=error.status, headers=error.headers)

    return openai_errors


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or an ApiError (415 wrong content type, 400 bad JSON / nesting / NaN)."""
    content_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if content_type not in JSON_CONTENT_TYPES and not content_type.endswith("+json"):
        raise ApiError(415, f"Content-Type must be application/json, got {content_type!r}",
                       code="unsupported_media_type")
    raw = await request.read()                   # over client_max_size: HTTPRequestEntityTooLarge (413)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:                       # the C parser's guard against deep nesting
        raise ApiError(400, "the request body nests too deeply") from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def forwarded_metadata(request: web.Request, names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Headers passed on as gRPC metadata; gRPC metadata values must be printable ASCII."""
    metadata = []
    for name in names:
        value = request.headers.get(name)
        if value is None:
            continue
        if not (value.isascii() and value.isprintable()):
            raise ApiError(400, f"the {name} header must be printable ASCII", param=name)
        metadata.append((name, value))
    return tuple(metadata)


def http_ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """HTTPS with the gRPC port's certificate and key (None = plaintext); client certificates are required when
    tls_client_ca is set, as on the gRPC port."""
    if not tls.tls_cert and not tls.tls_key:
        return None
    if not (tls.tls_cert and tls.tls_key):
        raise ValueError("TLS needs both tls_cert and tls_key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.tls_cert, tls.tls_key)
        if tls.tls_client_ca:
            context.load_verify_locations(tls.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the HTTP port's TLS certificate: {exc}") from None
    return context
