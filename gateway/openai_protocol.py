"""OpenAI wire format <-> specmesh.v1: request bodies to GenerateRequest, results to completion objects and chunks.

Pure functions on plain dicts (no I/O), used by gateway/openai_http.py. Unsupported OpenAI features (n > 1,
logprobs, echo, penalties, tools, token-id prompts) are refused with a 400 rather than silently ignored.
Extensions in the style of vLLM's `extra_body`: top_k, ignore_eos, num_draft_tokens.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import grpc

from protos.specmesh.v1 import common_pb2, generate_pb2

COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat defaults to the server's limit
UINT32_MAX = 2**32 - 1                # max_tokens, top_k, num_draft_tokens are uint32 in specmesh.v1
SEED_MAX = 2**63 - 1                  # sampling.seed: uint64 on the wire, the engines take 0 .. 2^63 - 1
FLOAT32_MAX = 3.4028234663852886e38
# specmesh.v1 field names in gRPC error messages -> the OpenAI names HTTP clients sent
OPENAI_FIELD_NAMES = {"max_new_tokens": "max_tokens", "sampling.temperature": "temperature",
                      "sampling.top_p": "top_p", "sampling.top_k": "top_k", "sampling.seed": "seed"}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH_REASONS = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_CONTEXT: "length",
}
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


@dataclass(frozen=True)
class ParsedRequest:
    request: generate_pb2.GenerateRequest
    model: str
    stream: bool
    include_usage: bool        # stream_options.include_usage: one more chunk with the usage at the end


def openai_field_names(message: str) -> tuple[str, str | None]:
    """A gRPC validation message with the OpenAI field names, and the field it starts with (OpenAI's `param`)."""
    for grpc_name, openai_name in OPENAI_FIELD_NAMES.items():
        message = re.sub(rf"(?<![\w.]){re.escape(grpc_name)}\b", openai_name, message)
    first = re.match(r"[A-Za-z_]+", message)
    known = set(OPENAI_FIELD_NAMES.values()) | {"prompt", "messages", "stop", "num_draft_tokens"}
    return message, first.group(0) if first and first.group(0) in known else None


def _text(value: str, param: str) -> str:
    """A string protobuf can carry: JSON allows lone surrogates (\\ud800), UTF-8 does not."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' is not valid Unicode (it holds a lone surrogate)", param=param) from None
    return value


def _int(body: dict[str, Any], key: str, low: int, high: int, default: int | None = None) -> int | None:
    value = _get(body, key, int, default)
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"'{key}' must be an integer in [{low}, {high}]", param=key)
    return value


def _float(body: dict[str, Any], key: str, default: float) -> float:
    value = _get(body, key, (int, float), default)
    try:
        number = float(value)
    except OverflowError:            # an integer beyond any float
        number = math.inf
    if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
        raise ApiError(400, f"'{key}' must be a finite number (a 32-bit float)", param=key)
    return number


def _get(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ApiError(400, f"'{key}' must be of type {'/'.join(k.__name__ for k in kinds)}", param=key)
    return value


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if _get(body, "n", int, 1) != 1 or _get(body, "best_of", int, 1) != 1:
        raise ApiError(400, "only n=1 (and best_of=1) is supported", param="n")
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo") or body.get("suffix"):
        raise ApiError(400, "logprobs, echo and suffix are not supported", param="logprobs")
    for key in ("presence_penalty", "frequency_penalty"):
        if _get(body, key, (int, float), 0) != 0:
            raise ApiError(400, f"'{key}' is not supported (it would change the target distribution)", param=key)
    if body.get("logit_bias") or body.get("tools") or body.get("functions"):
        raise ApiError(400, "logit_bias, tools and functions are not supported", param="tools")


def _stop_list(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [_text(stop, "stop")]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [_text(s, "stop") for s in stop]
    raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")


def _common(body: dict[str, Any], max_tokens: int, request: generate_pb2.GenerateRequest) -> ParsedRequest:
    _refuse_unsupported(body)
    model = _text(_get(body, "model", str, ""), "model")
    top_k = _int(body, "top_k", -1, UINT32_MAX, 0) or 0          # -1 (vLLM) and 0 both mean off
    sampling = common_pb2.SamplingParams(temperature=_float(body, "temperature", 1.0),
                                         top_p=_float(body, "top_p", 1.0), top_k=max(0, top_k))
    seed = _int(body, "seed", 0, SEED_MAX)
    if seed is not None:
        sampling.seed = seed
    request.sampling.CopyFrom(sampling)
    request.max_new_tokens = max_tokens
    request.stop.extend(_stop_list(body))
    request.ignore_eos = _get(body, "ignore_eos", bool, False)
    num_draft_tokens = _int(body, "num_draft_tokens", 0, UINT32_MAX)
    if num_draft_tokens is not None:
        request.num_draft_tokens = num_draft_tokens
    options = _get(body, "stream_options", dict, {})
    return ParsedRequest(request, model, _get(body, "stream", bool, False),
                         bool(options.get("include_usage", False)))


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string (batched and token-id prompts are not supported)",
                       param="prompt")
    max_tokens = _int(body, "max_tokens", 1, UINT32_MAX, COMPLETION_DEFAULT_MAX_TOKENS)
    return _common(body, max_tokens or 0, generate_pb2.GenerateRequest(prompt=_text(prompt, "prompt")))


def _message_text(content: Any, index: int) -> str:
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return _text(content, param)
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text", ""), str) for p in content):
        return _text("".join(p.get("text", "") for p in content), param)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts",
                   param=f"messages[{index}].content")


def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    request = generate_pb2.GenerateRequest()
    for i, message in enumerate(messages):
        role_name = message.get("role") if isinstance(message, dict) else None
        role = CHAT_ROLES.get(role_name) if isinstance(role_name, str) else None
        if role is None:
            raise ApiError(400, f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}", param=f"messages[{i}]")
        request.messages.add(role=role, content=_message_text(message.get("content"), i))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, 1, UINT32_MAX)          # None: the server's default
    return _common(body, max_tokens or 0, request)


def usage_dict(usage: generate_pb2.Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def finish_reason(reason: int) -> str | None:
    return FINISH_REASONS.get(reason)


def _choice(chat: bool, text: str, reason: str | None, delta: bool, role: bool = True) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    content: dict[str, Any] = {"role": "assistant", "content": text} if role else {"content": text}
    return {"index": 0, "delta" if delta else "message": content, "logprobs": None, "finish_reason": reason}


def completion_object(chat: bool, request_id: str, model: str, created: int, text: str, reason: str | None,
                      usage: dict[str, int] | None) -> dict[str, Any]:
    """The whole answer: `text_completion` or `chat.completion`."""
    return {"id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
            "choices": [_choice(chat, text, reason, delta=False)], "usage": usage}


def chunk_object(chat: bool, request_id: str, model: str, created: int, text: str | None, reason: str | None,
                 usage: dict[str, int] | None = None, first: bool = False) -> dict[str, Any]:
    """One server-sent event: a delta (text), the finish (reason), or the usage-only chunk (text None).
    A chat stream's first chunk carries the assistant role."""
    choices = [] if text is None else [_choice(chat, text, reason, delta=True, role=first)]
    chunk: dict[str, Any] = {"id": ("chatcmpl-" if chat else "cmpl-") + request_id,
                             "object": "chat.completion.chunk" if chat else "text_completion",
                             "created": created, "model": model, "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return chunk
