"""The OpenAI request fields the HTTP API takes, and what each must hold: every field either has its effect or is
refused with a 400 naming it (OpenAI itself answers an unrecognised argument with a 400). A field whose value is
null counts as absent.

Taken by both endpoints: model, stream, stream_options.include_usage and .continuous_usage_stats (vLLM's: usage so
far on every chunk), max_tokens, temperature, top_p, seed, stop, logit_bias, user (an end-user label: recorded
nowhere, it changes nothing, as on OpenAI), and the extensions top_k, min_p, repetition_penalty, ignore_eos,
num_draft_tokens (vLLM's `extra_body` style). Taken with their
default only (anything else is refused): n and best_of (1), logprobs, top_logprobs, echo and suffix (off),
presence_penalty and frequency_penalty (0), tools and functions (none), tool_choice and function_call ("none"),
response_format ({"type": "text"}: the server has no constrained decoding, so json_object / json_schema are
refused rather than answered with free text).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gateway.api_error import ApiError
from protos.specmesh.v1 import common_pb2
from specmesh.rpc.proto_convert import MAX_LOGIT_BIAS

UINT32_MAX = 2**32 - 1                # max_tokens, top_k, num_draft_tokens, token ids are uint32 in specmesh.v1
FLOAT32_MAX = 3.4028234663852886e38
_COMMON = frozenset({"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop",
                     "n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user",
                     "top_k", "min_p", "repetition_penalty", "ignore_eos", "num_draft_tokens"})
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "echo", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                         "tool_choice", "functions", "function_call"}
MESSAGE_FIELDS = frozenset({"role", "content"})


def text(value: str, param: str) -> str:
    """A string protobuf can carry: JSON allows lone surrogates (\\ud800), UTF-8 does not."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' is not valid Unicode (it holds a lone surrogate)", param=param) from None
    return value


def int_field(body: dict[str, Any], key: str, low: int, high: int, default: int | None = None) -> int | None:
    value: int | None = get(body, key, int, default)
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"'{key}' must be an integer in [{low}, {high}]", param=key)
    return value


def float_field(body: dict[str, Any], key: str, default: float) -> float:
    value = get(body, key, (int, float), default)
    try:
        number = float(value)
    except OverflowError:            # an integer beyond any float
        number = math.inf
    if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
        raise ApiError(400, f"'{key}' must be a finite number (a 32-bit float)", param=key)
    return number


def get(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ApiError(400, f"'{key}' must be of type {'/'.join(k.__name__ for k in kinds)}", param=key)
    return value


def check_fields(body: dict[str, Any], allowed: frozenset[str], where: str = "") -> None:
    """A 400 naming the first field (in sorted order) that is not in `allowed` (null values count as absent)."""
    unknown = sorted(k for k, v in body.items() if k not in allowed and v is not None)
    if unknown:
        name = f"{where}{unknown[0]}"
        raise ApiError(400, f"'{name}' is not supported by this server (supported: {', '.join(sorted(allowed))})",
                       param=name)


def _only_default(body: dict[str, Any], key: str, accepted: tuple[Any, ...], what: str) -> None:
    value = body.get(key)
    if value is not None and value not in accepted:
        raise ApiError(400, f"'{key}' is not supported: {what}", param=key)


def refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields taken with their default value only."""
    for key in ("n", "best_of"):
        if get(body, key, int, 1) != 1:
            raise ApiError(400, f"only {key}=1 is supported", param=key)
    for key in ("logprobs", "top_logprobs", "echo", "suffix"):
        _only_default(body, key, (False, 0, ""), "this server returns no log-probabilities, echo or suffix")
    for key in ("presence_penalty", "frequency_penalty"):
        if get(body, key, (int, float), 0) != 0:
            raise ApiError(400, f"'{key}' is not supported (use repetition_penalty)", param=key)
    for key in ("tools", "functions"):
        _only_default(body, key, ([],), "this server does not call tools")
    for key in ("tool_choice", "function_call"):
        _only_default(body, key, ("none",), 'this server does not call tools (only "none" is accepted)')
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise ApiError(400, f"'response_format' {json.dumps(kind)} is not supported: this server has no "
                       'constrained decoding (json_object / json_schema); only {"type": "text"} is accepted',
                       param="response_format")
    options = get(body, "stream_options", dict, {})
    check_fields(options, frozenset({"include_usage", "continuous_usage_stats"}), "stream_options.")
    for key, value in options.items():
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"'stream_options.{key}' must be of type bool", param=f"stream_options.{key}")


def sampling_extras(body: dict[str, Any], sampling: common_pb2.SamplingParams) -> None:
    """min_p, repetition_penalty and logit_bias into `sampling` (the ranges are checked again by the gateway)."""
    min_p = float_field(body, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise ApiError(400, "'min_p' must be in [0, 1]", param="min_p")
    penalty = float_field(body, "repetition_penalty", 1.0)
    if not 0.0 < penalty <= 100.0:
        raise ApiError(400, "'repetition_penalty' must be in (0, 100]", param="repetition_penalty")
    sampling.min_p = min_p
    if penalty != 1.0:
        sampling.repetition_penalty = penalty
    bias = get(body, "logit_bias", dict, {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS}",
                       param="logit_bias")
    for key, value in bias.items():
        if not (re.fullmatch(r"[0-9]{1,10}", key) and int(key) <= UINT32_MAX):
            raise ApiError(400, f"'logit_bias' keys must be token ids (decimal strings), got {key!r}",
                           param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"'logit_bias' values must be numbers in [-100, 100], got {value!r} for {key}",
                           param="logit_bias")
        sampling.logit_bias[int(key)] = float(value)
