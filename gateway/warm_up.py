"""Before the first request: a short generation of the gateway's own, per book, so that no user's request is the one
that measures the draft model.

A fresh gateway knows nothing of the draft model's cost (gateway/learned_priors.py: "unmeasured = free"), so its
first request tried it: a draft prefill of that request's prompt and model rounds, on the verifier's cores where the
draft service shares them. On the real pair (2-core Zen 4, int4, guidellm's synchronous benchmark, 256-token random
prompts) that request's inter-token latency was 70 ms against the others' 41-47: two model rounds of 280-350 ms and
undrafted rounds at ~80 ms beside the draft prefill. Here the gateway makes that measurement itself before it reports
SERVING: one generation of `num_tokens` tokens from a short built-in prompt for greedy requests and one for sampled
ones (each has its own book), through the same path as a request (verifier session, draft service, rounds), and books
what they measured as an ended request's. No client waits for it; it counts as a request that started alone (the
periodic exploration, learned_priors.EXPLORE_EVERY, counts on from it). A failure (draft service not up yet, say)
only leaves the books empty: the first request measures, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

log = logging.getLogger(__name__)

PROMPT = ("def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n"
          '    """Merge two sorted lists into one sorted list."""\n'
          "    merged = []\n    i = j = 0\n")
TEMPERATURES = (0.0, 1.0)           # the greedy book, then the sampled one
TIMEOUT_S = 120.0                   # per generation (a cold CPU host: the draft prefill and the first forwards)


class WarmsUp(Protocol):
    async def warm_up(self, prompt: str, max_new_tokens: int, temperature: float) -> int: ...


async def warm_up(servicer: WarmsUp, num_tokens: int) -> None:
    """The built-in generations, one per book; logs what they took (num_tokens 0: none)."""
    if num_tokens <= 0:
        return
    for temperature in TEMPERATURES:
        started = time.monotonic()
        try:
            emitted = await asyncio.wait_for(servicer.warm_up(PROMPT, num_tokens, temperature), TIMEOUT_S)
        except Exception as exc:       # never fatal: requests measure for themselves
            log.warning("warm-up generation (temperature %.0f) failed: %r; the first request measures", temperature,
                        exc)
            continue
        log.info("warm-up generation (temperature %.0f): %d tokens in %.1f s", temperature, emitted,
                 time.monotonic() - started)
