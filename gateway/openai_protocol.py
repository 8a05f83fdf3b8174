"""OpenAI wire format <-> specmesh.v1: request bodies to GenerateRequest, results to completion objects and chunks.

Pure functions on plain dicts (no I/O), used by gateway/openai_http.py. Unsupported OpenAI features (n > 1,
logprobs, echo, penalties, tools, token-id prompts) are refused with a 400 rather than silently ignored.
Extensions in the style of vLLM's `extra_body`: top_k, ignore_eos, num_draft_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from protos.specmesh.v1 import common_pb2, generate_pb2

COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat defaults to the server's limit
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
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, details: str) -> ApiError:
        status, type_ = HTTP_STATUS.get(code, (500, "server_error"))
        return cls(status, details or code.name, type_, code=code.name.lower())

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ParsedRequest:
    request: generate_pb2.GenerateRequest
    model: str
    stream: bool
    include_usage: bool        # stream_options.include_usage: one more chunk with the usage at the end


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
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")


def _common(body: dict[str, Any], max_tokens: int, request: generate_pb2.GenerateRequest) -> ParsedRequest:
    _refuse_unsupported(body)
    model = _get(body, "model", str, "")
    top_k = _get(body, "top_k", int, 0)
    sampling = common_pb2.SamplingParams(temperature=_get(body, "temperature", (int, float), 1.0),
                                         top_p=_get(body, "top_p", (int, float), 1.0), top_k=max(0, top_k))
    seed = _get(body, "seed", int)
    if seed is not None:
        sampling.seed = seed % 2**64
    request.sampling.CopyFrom(sampling)
    if max_tokens < 0:
        raise ApiError(400, "'max_tokens' must be positive", param="max_tokens")
    request.max_new_tokens = max_tokens
    request.stop.extend(_stop_list(body))
    request.ignore_eos = _get(body, "ignore_eos", bool, False)
    num_draft_tokens = _get(body, "num_draft_tokens", int)
    if num_draft_tokens is not None:
        request.num_draft_tokens = max(0, num_draft_tokens)
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
    max_tokens = _get(body, "max_tokens", int, COMPLETION_DEFAULT_MAX_TOKENS)
    return _common(body, max_tokens, generate_pb2.GenerateRequest(prompt=prompt))


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts",
                   param=f"messages[{index}].content")


def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    request = generate_pb2.GenerateRequest()
    for i, message in enumerate(messages):
        role = CHAT_ROLES.get(message.get("role")) if isinstance(message, dict) else None
        if role is None:
            raise ApiError(400, f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}", param=f"messages[{i}]")
        request.messages.add(role=role, content=_message_text(message.get("content"), i))
    max_tokens = _get(body, "max_completion_tokens", int, _get(body, "max_tokens", int, 0))
    return _common(body, max_tokens, request)


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
