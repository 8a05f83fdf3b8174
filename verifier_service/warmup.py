"""A verifier replica's own warm-up (`SPECMESH_VERIFIER_WARMUP_TOKENS` > 0): one greedy session through the engine
before health reports SERVING, so a replica that Kubernetes adds (or compose restarts) takes its first request warm.
The gateway's warm-up (gateway/server.py) reaches only the replica it places on.

The session prefills a short prompt, decodes `num_tokens` tokens, alternating undrafted verifies with verifies of 4
drafts (the multi-row path), then ends; its KV blocks are free again (evictable prompt blocks stay in the prefix
cache) before the replica opens. It is not a client session: no lease, no owner. ServiceServer.warm_up runs it and
holds SERVING until it ends; a failure is logged and the replica opens anyway, as it would have without a warm-up.
"""

from __future__ import annotations

import asyncio
import time

from specmesh.spec.sampling import SamplingParams
from verifier_service.engine import VerifierEngine

WARMUP_SESSION_ID = "specmesh-verifier-warmup"
WARMUP_PROMPT_TOKENS = 48
WARMUP_DRAFT_TOKENS = 4


async def warm_up_engine(engine: VerifierEngine, num_tokens: int, vocab_size: int) -> str:
    """Runs the warm-up session; returns one line saying what it did."""
    started = time.perf_counter()
    prompt_ids = [(1000 + 7 * i) % vocab_size for i in range(WARMUP_PROMPT_TOKENS)]
    start = await engine.start_session(WARMUP_SESSION_ID, prompt_ids, SamplingParams(),
                                       max_new_tokens=num_tokens).future
    generated = list(start.token_ids)
    try:
        while len(generated) < num_tokens:
            drafts = [generated[-1]] * WARMUP_DRAFT_TOKENS if len(generated) % 2 else []
            reply = await engine.verify(WARMUP_SESSION_ID, drafts, None, model_drafts=False).future
            generated += reply.token_ids
    finally:
        engine.end_session(WARMUP_SESSION_ID)
    while WARMUP_SESSION_ID in engine.sessions:
        await asyncio.sleep(0.01)
    return (f"warmed up: {len(prompt_ids)} prompt and {len(generated)} generated tokens in "
            f"{time.perf_counter() - started:.1f} s before reporting SERVING")

