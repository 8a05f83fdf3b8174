"""Checks of every input against the one table of caps (specmesh.config.InputLimits).

Each check raises an EngineError INVALID_ARGUMENT whose one-line message names the field, what it holds, the cap and
the environment variable that sets it; the HTTP API answers the same message as a 400 (param: the field). Used by
the gateway's validation and HTTP API and by the verifier's and draft service's servicers. Plain functions on
strings and counts: no I/O, testable without a model.
"""

from __future__ import annotations

from collections.abc import Sequence

from specmesh.config import InputLimits
from specmesh.engine.errors import EngineError


def _over(field: str, holds: str, cap: int, limit_name: str, service: str = "GATEWAY") -> EngineError:
    return EngineError("INVALID_ARGUMENT", f"{field} {holds}; the limit is {cap} "
                                           f"(SPECMESH_{service}_{limit_name.upper()})")


def check_prompt(prompt: str, limits: InputLimits, field: str = "prompt") -> None:
    if len(prompt) > limits.max_prompt_chars:
        raise _over(field, f"has {len(prompt)} characters", limits.max_prompt_chars, "max_prompt_chars")


def check_messages(contents: Sequence[str], limits: InputLimits, field: str = "messages") -> None:
    """`contents`: each message's text; the count and the total are capped."""
    if len(contents) > limits.max_messages:
        raise _over(field, f"has {len(contents)} messages", limits.max_messages, "max_messages")
    total = sum(len(c) for c in contents)
    if total > limits.max_prompt_chars:
        raise _over(field, f"hold {total} characters", limits.max_prompt_chars, "max_prompt_chars")


def check_stop(stop: Sequence[str], limits: InputLimits) -> None:
    if len(stop) > limits.max_stop_strings:
        raise _over("stop", f"has {len(stop)} strings", limits.max_stop_strings, "max_stop_strings")
    for i, s in enumerate(stop):
        if len(s) > limits.max_stop_string_len:
            raise _over(f"stop[{i}]", f"has {len(s)} characters", limits.max_stop_string_len, "max_stop_string_len")


def check_max_new_tokens(max_new_tokens: int, limits: InputLimits) -> None:
    if max_new_tokens > limits.max_new_tokens_limit:
        raise _over("max_new_tokens", f"is {max_new_tokens}", limits.max_new_tokens_limit, "max_new_tokens_limit")


def check_request_id(request_id: str, limits: InputLimits) -> None:
    if len(request_id) > limits.max_request_id_len:
        raise _over("request_id", f"has {len(request_id)} characters", limits.max_request_id_len,
                    "max_request_id_len")


def check_token_ids(count: int, limits: InputLimits, field: str, service: str) -> None:
    """Internal calls (verifier, draft service): token ids in one message."""
    if count > limits.max_token_ids:
        raise _over(field, f"has {count} token ids", limits.max_token_ids, "max_token_ids", service)


def field_of(exc: EngineError) -> str:
    """The field a cap's message names (without an index), for the HTTP API's `param`."""
    return str(exc).split(" ", 1)[0].split("[", 1)[0]
