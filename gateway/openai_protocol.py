"""OpenAI wire format <-> specmesh.v1: request bodies to GenerateRequest, results to completion objects and chunks.

Pure functions on plain dicts (no I/O), used by gateway/openai_http.py. Which fields are taken and which are
refused with a 400 (never silently ignored): gateway/openai_fields.py. Extensions in the style of vLLM's
`extra_body`: top_k, min_p, repetition_penalty, ignore_eos, num_draft_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.api_error import ApiError, openai_field_names
from gateway.openai_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MESSAGE_FIELDS,
    UINT32_MAX,
    check_fields,
    float_field,
    get,
    int_field,
    refuse_unsupported,
    sampling_extras,
    text,
)
from protos.specmesh.v1 import common_pb2, generate_pb2

__all__ = ["ApiError", "ParsedRequest", "openai_field_names"]   # ApiError is imported from here too

COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat defaults to the server's limit
SEED_MAX = 2**63 - 1                  # sampling.seed: uint64 on the wire, the engines take 0 .. 2^63 - 1
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH_REASONS = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_CONTEXT: "length",
}
@dataclass(frozen=True)
class ParsedRequest:
    request: generate_pb2.GenerateRequest
    model: str
    stream: bool
    include_usage: bool        # stream_options.include_usage: one more chunk with the usage at the end
    continuous_usage: bool = False     # stream_options.continuous_usage_stats: every chunk carries the usage so far


def _stop_list(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [text(stop, "stop")]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [text(s, "stop") for s in stop]
    raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")


def _common(body: dict[str, Any], max_tokens: int, request: generate_pb2.GenerateRequest) -> ParsedRequest:
    refuse_unsupported(body)
    get(body, "user", str)
    model = text(get(body, "model", str, ""), "model")
    top_k = int_field(body, "top_k", -1, UINT32_MAX, 0) or 0          # -1 (vLLM) and 0 both mean off
    sampling = common_pb2.SamplingParams(temperature=float_field(body, "temperature", 1.0),
                                         top_p=float_field(body, "top_p", 1.0), top_k=max(0, top_k))
    sampling_extras(body, sampling)
    seed = int_field(body, "seed", 0, SEED_MAX)
    if seed is not None:
        sampling.seed = seed
    request.sampling.CopyFrom(sampling)
    request.max_new_tokens = max_tokens
    request.stop.extend(_stop_list(body))
    request.ignore_eos = get(body, "ignore_eos", bool, False)
    num_draft_tokens = int_field(body, "num_draft_tokens", 0, UINT32_MAX)
    if num_draft_tokens is not None:
        request.num_draft_tokens = num_draft_tokens
    options = get(body, "stream_options", dict, {})
    stream = get(body, "stream", bool, False)
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed with stream: true", param="stream_options")
    return ParsedRequest(request, model, stream,
                         bool(options.get("include_usage", False)), bool(options.get("continuous_usage_stats", False)))


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string (batched and token-id prompts are not supported)",
                       param="prompt")
    max_tokens = int_field(body, "max_tokens", 1, UINT32_MAX, COMPLETION_DEFAULT_MAX_TOKENS)
    return _common(body, max_tokens or 0, generate_pb2.GenerateRequest(prompt=text(prompt, "prompt")))


def _message_text(content: Any, index: int) -> str:
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return text(content, param)
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text", ""), str) for p in content):
        return text("".join(p.get("text", "") for p in content), param)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts",
                   param=f"messages[{index}].content")


def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    request = generate_pb2.GenerateRequest()
    for i, message in enumerate(messages):
        role_name = message.get("role") if isinstance(message, dict) else None
        role = CHAT_ROLES.get(role_name) if isinstance(role_name, str) else None
        if role is None:
            raise ApiError(400, f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}", param=f"messages[{i}]")
        check_fields(message, MESSAGE_FIELDS, f"messages[{i}].")
        request.messages.add(role=role, content=_message_text(message.get("content"), i))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = int_field(body, key, 1, UINT32_MAX)          # None: the server's default
    return _common(body, max_tokens or 0, request)


def usage_dict(usage: generate_pb2.Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def finish_reason(reason: common_pb2.FinishReason) -> str | None:
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
