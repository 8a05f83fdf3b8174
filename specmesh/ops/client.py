"""A small Python client for the public API (used by `specmesh generate`, the benchmark and the tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from protos.specmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc


def make_request(prompt: str = "", *, messages: Sequence[tuple[str, str]] = (), max_new_tokens: int = 0,
                 temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0, seed: int | None = None,
                 stop: Sequence[str] = (), num_draft_tokens: int | None = None,
                 ignore_eos: bool = False, min_p: float = 0.0, repetition_penalty: float = 0.0,
                 logit_bias: dict[int, float] | None = None) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                         # 1 = off, sent as the field's default 0 (also off), as proto_convert does
                                         repetition_penalty=0.0 if repetition_penalty == 1.0 else repetition_penalty,
                                         logit_bias=logit_bias or {})
    if seed is not None:
        sampling.seed = seed
    request = generate_pb2.GenerateRequest(
        prompt=prompt, messages=[generate_pb2.ChatMessage(role=r, content=c) for r, c in messages],
        sampling=sampling, max_new_tokens=max_new_tokens, stop=list(stop), ignore_eos=ignore_eos)
    if num_draft_tokens is not None:
        request.num_draft_tokens = num_draft_tokens
    return request


async def stream(addr: str, request: generate_pb2.GenerateRequest, timeout_s: float | None = None,
                 api_key: str = "") -> AsyncIterator[generate_pb2.GenerateResponse]:
    """api_key: sent as `authorization: Bearer <key>` where given."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        async for response in stub.Generate(request, timeout=timeout_s, metadata=metadata):
            yield response


CONNECT_FAILURES = ("failed to connect", "connection refused", "dns resolution failed", "name resolution",
                    "connect failed", "connection reset", "socket closed", "no route to host")


def finish_reason_words(value: int) -> str:
    """`length`, `stop` (end of sequence), `stop string`, `context` (as examples/node/client.js prints them)."""
    return common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower().replace("_", " ")


def describe_rpc_error(exc: grpc.RpcError, addr: str) -> str:
    """One line: the status code name and a clear text (naming the gateway when it cannot be reached)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    relayed = details.startswith(("verifier", "draft"))  # the gateway passing on its own backend's error
    if code == grpc.StatusCode.UNAVAILABLE and not relayed and any(s in details.lower() for s in CONNECT_FAILURES):
        return f"{code.name}: cannot reach the gateway at {addr} (is 'specmesh up' running?)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not details:
        details = "the request did not finish in time"
    return f"{code.name}: {details or 'no details'}"
