"""Redis bytes per cached token: runs N generations' worth of verified tokens through the Redis draft cache.

Starts a private redis-server on a free port, writes what the gateway writes for each generation (every output
position: its last 8 context tokens -> the next 16 verified tokens, under each configured suffix length; see
`gateway/proposers/cache.py` `ContinuationWriter`), then reports Redis `used_memory` growth, the sum of `MEMORY USAGE`
over the cache's keys, the key count, and each per cached (generated) token. Prints the numbers and writes JSON to
bench/results/redis_bytes-*.json.

  .venv/bin/python -m bench.redis_bytes --generations 200 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from redis.asyncio import Redis

from bench.common import log, result_paths, run_metadata, write_json
from kvstore.base import MAX_CONTINUATION_TOKENS
from kvstore.factory import CacheSettings, open_cache
from tests.redis_server import RedisServer

CONTEXT_TAIL = 8
ARMS = {"secret only (default)": "", "secret + explicit AES key": "00" * 32}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per generation")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=151_936, help="token ids drawn uniformly below this")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


async def used_memory(client: Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


async def key_bytes(client: Redis) -> tuple[int, int]:
    """(number of keys, sum of MEMORY USAGE over them)."""
    keys, total = 0, 0
    async for key in client.scan_iter(count=1000):
        keys += 1
        total += int(await client.memory_usage(key, samples=0) or 0)
    return keys, total


async def write_generations(cache: Any, args: argparse.Namespace, rng: random.Random) -> None:
    for g in range(args.generations):
        prompt = [rng.randrange(args.vocab) for _ in range(args.prompt_tokens)]
        out = [rng.randrange(args.vocab) for _ in range(args.tokens)]
        for p in range(len(out)):
            context = (prompt + out[:p])[-CONTEXT_TAIL:]
            cache.record(f"tenant:t{g % 4}", context, out[p:p + MAX_CONTINUATION_TOKENS])
        await cache.flush(30.0)


async def run_arm(redis: RedisServer, encryption_key: str, args: argparse.Namespace) -> dict[str, float]:
    client = Redis.from_url(redis.url)
    await client.flushall()
    before = await used_memory(client)
    settings = CacheSettings(redis.url, secret="bench-secret", encryption_key=encryption_key)
    cache = open_cache(settings, "bench-model", "bench-tokenizer")
    started = time.perf_counter()
    await write_generations(cache, args, random.Random(args.seed))
    seconds = time.perf_counter() - started
    await cache.close()
    after = await used_memory(client)
    num_keys, usage = await key_bytes(client)
    await client.aclose()
    tokens = args.generations * args.tokens
    return {"cached_tokens": tokens, "keys": num_keys, "keys_per_token": num_keys / tokens,
            "used_memory_growth_bytes": after - before, "used_memory_per_token": (after - before) / tokens,
            "memory_usage_bytes": usage, "memory_usage_per_token": usage / tokens,
            "dropped": cache.counters.dropped, "write_seconds": seconds}


async def main() -> None:
    args = parse_args()
    redis = RedisServer().start()
    try:
        arms = {name: await run_arm(redis, key, args) for name, key in ARMS.items()}
    finally:
        redis.kill()
    for name, r in arms.items():
        log(f"{name:28s} {r['used_memory_per_token']:7.0f} B/token used_memory, "
            f"{r['memory_usage_per_token']:7.0f} B/token MEMORY USAGE, {r['keys_per_token']:.2f} keys/token "
            f"({r['keys']} keys, {r['dropped']} dropped records)")
    path, _ = result_paths("redis_bytes")
    write_json(path, {"meta": run_metadata(args), "arms": arms})


if __name__ == "__main__":
    asyncio.run(main())
