"""OpenAI's error object: an HTTP status with `{"error": {message, type, param, code}}`, and the gRPC status each
specmesh.v1 error maps to (with the OpenAI field names in its message)."""

from __future__ import annotations

import re
from typing import Any

import grpc

# specmesh.v1 field names in gRPC error messages -> the OpenAI names HTTP clients sent
OPENAI_FIELD_NAMES = {"max_new_tokens": "max_tokens", "sampling.temperature": "temperature",
                      "sampling.top_p": "top_p", "sampling.top_k": "top_k", "sampling.seed": "seed",
                      "sampling.min_p": "min_p", "sampling.repetition_penalty": "repetition_penalty",
                      "sampling.logit_bias": "logit_bias"}

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` body with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, relayed: bool = False, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.relayed = relayed      # answered by the gRPC service (already counted in its metrics)
        self.headers = headers or {}  # extra response headers (Retry-After on a 429 / 503)

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, details: str, relayed: bool = True) -> ApiError:
        """The HTTP error of a gRPC status (relayed: the gRPC service answered it, and counted it)."""
        status, type_ = HTTP_STATUS.get(code, (500, "server_error"))
        message, param = openai_field_names(details or code.name)
        return cls(status, message, type_, param=param, code=code.name.lower(), relayed=relayed)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def openai_field_names(message: str) -> tuple[str, str | None]:
    """A gRPC validation message with the OpenAI field names, and the field it starts with (OpenAI's `param`)."""
    for grpc_name, openai_name in OPENAI_FIELD_NAMES.items():
        message = re.sub(rf"(?<![\w.]){re.escape(grpc_name)}\b", openai_name, message)
    first = re.match(r"[A-Za-z_]+", message)
    known = set(OPENAI_FIELD_NAMES.values()) | {"prompt", "messages", "stop", "num_draft_tokens"}
    return message, first.group(0) if first and first.group(0) in known else None
