"""Validation of public requests: every rejection is INVALID_ARGUMENT with a message naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from google.protobuf import unknown_fields
from google.protobuf.message import Message
from transformers import PreTrainedTokenizerBase

from gateway.safe_parse import UndecodableRequest
from protos.specmesh.v1 import generate_pb2
from specmesh.config import GatewayConfig
from specmesh.engine.loop import EngineError
from specmesh.rpc.limits import check_max_new_tokens, check_messages, check_prompt, check_request_id, check_stop
from specmesh.rpc.proto_convert import sampling_from_proto
from specmesh.spec.sampling import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class GenerationParams:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop: tuple[str, ...]
    num_draft_tokens: int
    ignore_eos: bool


def invalid(message: str) -> EngineError:
    return EngineError("INVALID_ARGUMENT", message)


def _prompt_text(request: generate_pb2.GenerateRequest, tokenizer: PreTrainedTokenizerBase,
                 config: GatewayConfig) -> str:
    if request.prompt and request.messages:
        raise invalid("set either prompt or messages, not both")
    if request.messages:
        check_messages([m.content for m in request.messages], config.limits)
        for i, msg in enumerate(request.messages):
            if msg.role not in CHAT_ROLES:
                raise invalid(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {msg.role!r}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise invalid("messages: the model has no chat template; send a plain prompt")
        chat = [{"role": m.role, "content": m.content} for m in request.messages]
        return cast(str, tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))  # text
    check_prompt(request.prompt, config.limits)
    if not request.prompt.strip():
        raise invalid("prompt must not be empty")
    return request.prompt


def _refuse_unknown_fields(request: generate_pb2.GenerateRequest) -> None:
    """A field this server's specmesh.v1 does not know (a newer client's) would be dropped silently: refuse it."""
    parts: list[tuple[str, Message]] = [("request", request)]      # sampling: in sampling_from_proto
    parts += [(f"messages[{i}]", m) for i, m in enumerate(request.messages)]
    for name, message in parts:
        fields = unknown_fields.UnknownFieldSet(message)
        numbers = [fields[i].field_number for i in range(len(fields))]
        if numbers:
            raise invalid(f"{name} has field number {numbers[0]}, which this server does not know (a newer "
                          "specmesh.v1?); it would be ignored")


def _check_logit_bias(sampling: SamplingParams, tokenizer: PreTrainedTokenizerBase) -> None:
    if not sampling.logit_bias:
        return
    vocab_size = len(tokenizer)
    bad = [t for t, _ in sampling.logit_bias if t >= vocab_size]
    if bad:
        raise invalid(f"sampling.logit_bias: token id {bad[0]} is not in the vocabulary (ids < {vocab_size})")


def _stop_strings(request: generate_pb2.GenerateRequest, config: GatewayConfig) -> tuple[str, ...]:
    check_stop(request.stop, config.limits)
    for i, s in enumerate(request.stop):
        if not s:
            raise invalid(f"stop[{i}] must not be empty")
    return tuple(request.stop)


def validate_request(request: generate_pb2.GenerateRequest | UndecodableRequest, tokenizer: PreTrainedTokenizerBase,
                     config: GatewayConfig, max_model_len: int, default_request_id: str) -> GenerationParams:
    if isinstance(request, UndecodableRequest):
        raise invalid(f"request is not a valid specmesh.v1.GenerateRequest: {request.reason}")
    check_request_id(request.request_id, config.limits)
    _refuse_unknown_fields(request)
    sampling = sampling_from_proto(request.sampling)
    _check_logit_bias(sampling, tokenizer)
    max_new_tokens = request.max_new_tokens or config.default_max_new_tokens
    check_max_new_tokens(max_new_tokens, config.limits)
    num_draft = request.num_draft_tokens if request.HasField("num_draft_tokens") else config.num_draft_tokens
    if num_draft > config.max_draft_tokens:
        raise invalid(f"num_draft_tokens must be <= {config.max_draft_tokens}, got {num_draft}")
    stop = _stop_strings(request, config)
    text = _prompt_text(request, tokenizer, config)
    prompt_ids = tokenizer(text, add_special_tokens=not request.messages)["input_ids"]
    if not prompt_ids:
        raise invalid("prompt encodes to zero tokens")
    if len(prompt_ids) + max_new_tokens > max_model_len:
        raise invalid(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                      f"model's context length ({max_model_len})")
    return GenerationParams(request.request_id or default_request_id, list(prompt_ids), sampling, max_new_tokens,
                            stop, num_draft, request.ignore_eos)
