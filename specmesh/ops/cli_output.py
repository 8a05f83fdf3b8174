"""What `specmesh generate` and `specmesh run` print: the streamed text and its footer, and `CliError`, an error whose
message is already the one line the user reads. Shared by `cli` and `pipeline_cli` (which cli imports)."""

from __future__ import annotations

import sys
import time

import grpc

from specmesh.ops import client


class CliError(Exception):
    """An error whose message is already what the user should read."""


async def print_stream(addr: str, request: client.generate_pb2.GenerateRequest) -> int:
    start = time.perf_counter()
    first_at = None
    try:
        async for response in client.stream(addr, request):
            if response.text:
                first_at = first_at or time.perf_counter()
                sys.stdout.write(response.text)
                sys.stdout.flush()
            if response.HasField("usage"):
                _print_footer(response, time.perf_counter() - start, first_at and first_at - start)
    except grpc.RpcError as exc:
        raise CliError(client.describe_rpc_error(exc, addr)) from exc
    return 0


def _print_footer(response: client.generate_pb2.GenerateResponse, elapsed: float, ttft: float | None) -> None:
    u = response.usage
    first = f"{ttft * 1000:.0f} ms" if ttft else "n/a"
    print(f"\n\n[{u.completion_tokens} tokens in {elapsed:.2f} s ({u.completion_tokens / elapsed:.2f} tok/s), "
          f"time to first text {first}, {u.num_rounds} rounds, acceptance {u.acceptance_rate:.2f}, "
          f"{u.mean_tokens_per_round:.2f} tokens/round, finish {client.finish_reason_words(response.finish_reason)}, "
          f"request {response.request_id}]", file=sys.stderr)
