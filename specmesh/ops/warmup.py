"""One short generation through a stack that has just come up, before anyone else's request (`specmesh up`, the
stacks of the benchmarks' `--start-stack` and of bench.guidellm_sweep), as llama-server runs a warm-up decode
when it loads a model.

A fresh stack's first request pays one-off costs: the gateway's first chat template and channels to the verifier and
the draft service, each service's first forward (kernel pool threads started, the KV pool's first pages). On the
2-core Zen 5 with the real pair (`specmesh up --preset qwen`, fresh each time, 64-token requests), the first request
reached its first token in 599-773 ms without a warm-up (the next ones: 76-130 ms) and in 163-240 ms after this
16-token one. Its inter-token gap did not settle: whether a request tries the draft model is the gateway's
learned priors' choice (gateway/learned_priors.py), and requests after the warm-up still tried it.

The warm-up is two ordinary requests of `num_tokens` each, one greedy and one sampled (temperature 1, seeded): the
gateway keeps what its requests learned apart for greedy and sampled ones, and a sampled request prices the draft
model by its own book once it has one. With only a greedy warm-up, the first sampled client request priced a model
round at the greedy warm-up's cost (~100 ms for 4 drafts on the 2-core Zen 5), so it tried the model: a draft
prefill of its prompt (562 ms beside its first rounds, which ran 113-120 ms instead of 27) and five model rounds of
158-267 ms (a sampled Propose of 4 drafts took 107-189 ms there); at 42.6-49.1 ms a token it set guidellm's
synchronous p99 inter-token latency, the other requests 21-35 ms. Both requests show in the metrics and the trace
like any other.

A gateway started on its own (docker-compose, Kubernetes) runs the same generation through its own gRPC server when
`SPECMESH_GATEWAY_WARMUP_TOKENS` > 0 (the deploy files set 16), and reports SERVING only after it
(`gateway.server.warm_up_gateway`): a readiness probe sends no traffic to a cold gateway.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from specmesh.ops import client

WARMUP_MESSAGES = (("user", "Write a Python function that returns the n-th Fibonacci number."),)
WARMUP_SAMPLING = ((0.0, None), (1.0, 0))    # (temperature, seed): greedy, then sampled (see above)
DEFAULT_WARMUP_TOKENS = 16


async def _generate(addr: str, num_tokens: int, timeout_s: float, api_key: str) -> int:
    num_generated = 0
    for temperature, seed in WARMUP_SAMPLING:
        request = client.make_request(messages=WARMUP_MESSAGES, max_new_tokens=num_tokens, ignore_eos=True,
                                      temperature=temperature, seed=seed)
        async for response in client.stream(addr, request, timeout_s, api_key):
            num_generated += len(response.token_ids)
    return num_generated


async def warm_up_async(addr: str, num_tokens: int = DEFAULT_WARMUP_TOKENS, timeout_s: float = 300.0,
                        api_key: str = "") -> str:
    """The warm-up generation against the gateway at `addr` (host:port, or the gateway's own unix: loopback), with
    `api_key` where the gateway wants one; returns one line saying how it went. A failure (a gateway that wants an
    API key, a timeout, a verifier that is down) is reported in that line, never raised: the stack serves as it
    would have without it."""
    started = time.perf_counter()
    try:
        num_generated = await _generate(addr, num_tokens, timeout_s, api_key)
    except grpc.RpcError as exc:
        return f"warm-up skipped: {client.describe_rpc_error(exc, addr)}"
    seconds = time.perf_counter() - started
    return f"warmed up: {num_generated} tokens in {seconds:.1f} s (a fresh stack's one-off costs, before any client)"


def warm_up(addr: str, num_tokens: int = DEFAULT_WARMUP_TOKENS, timeout_s: float = 300.0) -> str:
    """`warm_up_async` from synchronous code (`specmesh up`, the benchmarks' stacks)."""
    return asyncio.run(warm_up_async(addr, num_tokens, timeout_s))
