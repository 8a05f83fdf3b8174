"""A draft replica's own warm-up (`SPECMESH_DRAFT_WARMUP_TOKENS` > 0): one greedy session through the engine before
health reports SERVING, so a draft replica that Kubernetes adds (or compose restarts) drafts its first block warm.
The gateway's warm-up (gateway/server.py) reaches only the replica it links to, and only when its cost model chooses
the draft model for that one generation.

The session sends a short prompt, then proposes blocks of 4 tokens as a gateway would: rounds alternate between a
verifier that accepts the whole block (plus its own next token: the drafts made ahead are kept) and one that accepts
half of it and corrects the next token (the tail is rolled back), until `num_tokens` tokens were drafted. Then it
ends, and its KV blocks are free again before the replica opens. It is not a client session: no lease, no owner.
ServiceServer.warm_up runs it and holds SERVING until it ends; a failure is logged and the replica opens anyway.
"""

from __future__ import annotations

import asyncio
import time

from draft_service.engine import DraftEngine
from specmesh.spec.sampling import SamplingParams

WARMUP_SESSION_ID = "specmesh-draft-warmup"
WARMUP_PROMPT_TOKENS = 48
WARMUP_DRAFT_TOKENS = 4


def _verdict(drafts: list[int], round_index: int, vocab_size: int) -> list[int]:
    """The tokens a verifier would send back for this round: every draft and one more, or half and a correction."""
    if round_index % 2 == 0:
        return drafts + [(drafts[-1] + 1) % vocab_size if drafts else 0]
    kept = drafts[:len(drafts) // 2]
    rejected = drafts[len(kept)] if len(drafts) > len(kept) else 0
    return kept + [(rejected + 1) % vocab_size]


async def warm_up_engine(engine: DraftEngine, num_tokens: int, vocab_size: int, max_q_entries: int) -> str:
    """Runs the warm-up session; returns one line saying what it did."""
    started = time.perf_counter()
    context = [(1000 + 7 * i) % vocab_size for i in range(WARMUP_PROMPT_TOKENS)]
    new_ids, num_drafted, round_index = list(context), 0, 0
    try:
        while num_drafted < num_tokens:
            proposal = await engine.propose(WARMUP_SESSION_ID, len(context), new_ids, WARMUP_DRAFT_TOKENS,
                                            SamplingParams(), max_q_entries).future
            num_drafted += len(proposal.draft_ids)
            new_ids = _verdict(list(proposal.draft_ids), round_index, vocab_size)
            context += new_ids
            round_index += 1
    finally:
        engine.end_session(WARMUP_SESSION_ID)
    while WARMUP_SESSION_ID in engine.sessions or engine.block_manager.num_used_blocks:
        await asyncio.sleep(0.01)
    return (f"warmed up: {WARMUP_PROMPT_TOKENS} prompt and {num_drafted} drafted tokens in {round_index} rounds in "
            f"{time.perf_counter() - started:.1f} s before reporting SERVING")
