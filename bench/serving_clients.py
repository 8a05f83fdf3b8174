"""Streaming clients for the serving benchmark (bench/serving.py): specmesh's gRPC Generate stream and an
OpenAI-compatible HTTP server's SSE stream (llama-server), each recording when every message arrived and how many
tokens it carried; an open-loop driver that sends each request at its arrival time whatever is still running; and
the per-run statistics.

Latency terms (all from the client's clock):
- TTFT: request sent -> first token.
- Inter-token latency (ITL): a message of n tokens that came g seconds after the previous one gives n samples of
  g / n (a speculative round's tokens share its gap; llama-server streams one token a message; over SSE a content
  chunk counts as one token, the final usage chunk gives the total).
- Stall: the longest gap between two messages of one stream (the time its user saw nothing).
- Throughput: all completion tokens / (last completion - first send).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import grpc

from bench.common import fresh_tenant
from bench.serving_mix import TrafficRequest
from gateway.tiers import TENANT_HEADER
from protos.specmesh.v1 import generate_pb2_grpc
from specmesh.ops import client

REQUEST_TIMEOUT_S = 3600.0


@dataclass
class StreamResult:
    id: str
    kind: str
    config: str                  # "target", "spec" or "llama-server"
    arrival_s: float             # scheduled send time after the run's start
    max_tokens: int
    sent_s: float = 0.0          # actual send time after the run's start
    end_s: float = 0.0           # after the run's start
    completion_tokens: int = 0
    messages: list[tuple[float, int]] = field(default_factory=list)   # (seconds after send, tokens) per message
    token_ids: list[int] = field(default_factory=list)                # (gRPC only: to check exactness)
    error: str = ""

    def add(self, sent: float, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self.messages.append((time.perf_counter() - sent, num_tokens))
        self.completion_tokens += num_tokens

    @property
    def ttft_s(self) -> float:
        return self.messages[0][0] if self.messages else 0.0

    def gaps(self) -> list[tuple[float, int]]:
        """(seconds since the previous message, tokens) for every message after the first."""
        return [(t - prev, n) for (prev, _), (t, n) in zip(self.messages, self.messages[1:], strict=False)]

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("messages", "token_ids")} | {
            "ttft_s": self.ttft_s, "max_gap_s": max((g for g, _ in self.gaps()), default=0.0)}


Send = Callable[[TrafficRequest, StreamResult], Awaitable[None]]


def grpc_sender(addr: str, num_draft_tokens: int | None) -> tuple[Send, Callable[[], Awaitable[None]]]:
    """Streams from specmesh's gateway (one channel for the run): num_draft_tokens 0 = target-only, None = the
    gateway's defaults. Returns (send, close)."""
    channel = grpc.aio.insecure_channel(addr)
    stub = generate_pb2_grpc.GenerationStub(channel)

    async def send(request: TrafficRequest, result: StreamResult) -> None:
        message = client.make_request(messages=request.messages, max_new_tokens=request.max_tokens,
                                      num_draft_tokens=num_draft_tokens, ignore_eos=True)
        sent = time.perf_counter()
        try:
            async for response in stub.Generate(message, timeout=REQUEST_TIMEOUT_S,
                                                metadata=((TENANT_HEADER, fresh_tenant()),)):
                result.add(sent, len(response.token_ids))
                result.token_ids.extend(response.token_ids)
        except grpc.aio.AioRpcError as exc:
            result.error = f"{exc.code().name}: {exc.details()}"
    return send, channel.close


def http_sender(base_url: str, extra_fields: dict[str, object] | None = None
                ) -> tuple[Send, Callable[[], Awaitable[None]]]:
    """Streams /v1/chat/completions (greedy, ignore_eos) from an OpenAI-compatible server; `extra_fields` go into
    every request body as they are (llama-server's `cache_prompt: false`, a field specmesh refuses)."""
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))

    async def send(request: TrafficRequest, result: StreamResult) -> None:
        body = {"messages": [{"role": r, "content": c} for r, c in request.messages], "max_tokens": request.max_tokens,
                "temperature": 0, "top_k": 1, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, **(extra_fields or {})}
        sent = time.perf_counter()
        try:
            async with session.post(f"{base_url}/v1/chat/completions", json=body) as reply:
                if reply.status != 200:
                    result.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                    return
                async for line in reply.content:
                    _sse_line(line.decode(errors="replace").strip(), sent, result)
        except (TimeoutError, aiohttp.ClientError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
    return send, session.close


def _sse_line(line: str, sent: float, result: StreamResult) -> None:
    """One SSE line: a chunk with content counts as one token (llama-server streams token by token); the usage
    chunk at the end (stream_options.include_usage) sets the completion's true token count."""
    if not line.startswith("data:") or line == "data: [DONE]":
        return
    chunk = json.loads(line.removeprefix("data:").strip())
    for choice in chunk.get("choices", []):
        if (choice.get("delta") or {}).get("content"):
            result.add(sent, 1)
    if (usage := chunk.get("usage")) and usage.get("completion_tokens"):
        result.completion_tokens = int(usage["completion_tokens"])


async def run_open_loop(send: Send, requests: Sequence[TrafficRequest], offsets: Sequence[float],
                        config: str) -> tuple[list[StreamResult], float]:
    """Each request sent at its offset after the start, however many are still streaming; (results, wall s)."""
    start = time.perf_counter()

    async def one(request: TrafficRequest, offset: float) -> StreamResult:
        result = StreamResult(request.id, request.kind, config, offset, request.max_tokens)
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        result.sent_s = time.perf_counter() - start
        await send(request, result)
        result.end_s = time.perf_counter() - start
        return result

    results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets, strict=True)))
    return list(results), time.perf_counter() - start


# ------------------------------------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (q in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(results: Sequence[StreamResult]) -> dict[str, Any]:
    ok = [r for r in results if not r.error and r.messages]
    itl = [g / n for r in ok for g, n in r.gaps() for _ in range(n)]
    stalls = [(max((g for g, _ in r.gaps()), default=0.0), r.id) for r in ok]
    longest = max(stalls, default=(0.0, ""))
    tokens = sum(r.completion_tokens for r in ok)
    span = max((r.end_s for r in ok), default=0.0) - min((r.sent_s for r in ok), default=0.0)
    by_kind = {kind: [r.ttft_s for r in ok if r.kind == kind] for kind in sorted({r.kind for r in ok})}
    return {
        "requests": len(results), "errors": sum(bool(r.error) for r in results), "completion_tokens": tokens,
        "throughput_tok_s": tokens / span if span > 0 else 0.0,
        "ttft_p50_s": percentile([r.ttft_s for r in ok], 50), "ttft_p99_s": percentile([r.ttft_s for r in ok], 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "max_stall_s": longest[0], "max_stall_request": longest[1],
        "ttft_p50_s_by_kind": {k: percentile(v, 50) for k, v in by_kind.items()},
        "ttft_p99_s_by_kind": {k: percentile(v, 99) for k, v in by_kind.items()},
    }
