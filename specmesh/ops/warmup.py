"""One short generation through a stack that has just come up, before anyone else's request (`specmesh up`, the
stacks of the benchmarks' `--start-stack` and of bench.guidellm_sweep), as llama-server runs a warm-up decode
when it loads a model.

A fresh stack's first request pays one-off costs: the gateway's first chat template and channels to the verifier and
the draft service, each service's first forward (kernel pool threads started, the KV pool's first pages). On the
2-core Zen 5 with the real pair (`specmesh up --preset qwen`, fresh each time, 64-token requests), the first request
reached its first token in 599-773 ms without a warm-up (the next ones: 76-130 ms) and in 163-240 ms after this
16-token one. Its inter-token gap did not settle: whether a request tries the draft model is the gateway's
learned priors' choice (gateway/learned_priors.py), and requests after the warm-up still tried it. The warm-up is an
ordinary greedy request: it shows in the metrics and the trace like any other.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from specmesh.ops import client

WARMUP_MESSAGES = (("user", "Write a Python function that returns the n-th Fibonacci number."),)
DEFAULT_WARMUP_TOKENS = 16


async def _generate(addr: str, num_tokens: int, timeout_s: float) -> int:
    request = client.make_request(messages=WARMUP_MESSAGES, max_new_tokens=num_tokens, ignore_eos=True)
    num_generated = 0
    async for response in client.stream(addr, request, timeout_s):
        num_generated += len(response.token_ids)
    return num_generated


def warm_up(addr: str, num_tokens: int = DEFAULT_WARMUP_TOKENS, timeout_s: float = 300.0) -> str:
    """Runs the warm-up generation against the gateway at `addr`; returns one line saying how it went. A failure
    (a gateway that wants an API key, a timeout) is reported in that line, never raised: the stack is up either
    way and serves as it would have without it."""
    started = time.perf_counter()
    try:
        num_generated = asyncio.run(_generate(addr, num_tokens, timeout_s))
    except grpc.RpcError as exc:
        return f"warm-up skipped: {client.describe_rpc_error(exc, addr)}"
    seconds = time.perf_counter() - started
    return f"warmed up: {num_generated} tokens in {seconds:.1f} s (a fresh stack's one-off costs, before any client)"
