"""Sampled streams in mixed traffic (issue 27): seeded and unseeded requests, decoding ahead, random draft lengths and
top-k / top-p, beside prompts near the context limit, with the draft service stopped while they run. No request
fails, every seeded output equals the same seed's target-only output, and every KV block comes back."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable

from transformers import AutoTokenizer

from specmesh.models import resolve_model_dir
from tests.stack import start_draft, start_gateway, start_verifier
from tests.test_e2e_greedy import PROMPTS, generate, wait_blocks_free
from tests.test_mixed_traffic import MAX_MODEL_LEN, STEP_BUDGET, WORDS, near_context_prompt


def sampled_jobs(rng: random.Random, prompts: list[str]) -> list[dict]:
    """One request per prompt: temperature 0.6-1.2, sometimes top-k / top-p, a seed for all but every fourth."""
    return [{"prompt": prompt, "max_new_tokens": rng.randint(12, 32), "temperature": rng.uniform(0.6, 1.2),
             "top_k": rng.choice([0, 0, 5, 40]), "top_p": rng.choice([0.0, 0.0, 0.9]),
             "seed": None if i % 4 == 3 else 1000 + i} for i, prompt in enumerate(prompts)]


async def test_sampled_streams_beside_near_context_prompts_and_a_stopped_draft_service() -> None:
    rng = random.Random(27)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    verifier = await start_verifier(max_num_batched_tokens=STEP_BUDGET, max_model_len=MAX_MODEL_LEN, block_size=8,
                                    decode_ahead_tokens=8)
    draft = await start_draft("tiny-draft")
    gateways = [await start_gateway(verifier.addr, draft.addr),
                await start_gateway(verifier.addr, draft.addr, suffix_drafting=True, enable_ngram=True)]
    draft_stopped = False
    try:
        preamble = " ".join(rng.choice(WORDS) for _ in range(60))
        long_prompts = [near_context_prompt(tokenizer, rng, preamble, MAX_MODEL_LEN - 40 - i) for i in range(2)]
        short_prompts = [PROMPTS[i % len(PROMPTS)] + " " + rng.choice(WORDS) for i in range(10)]
        jobs = sampled_jobs(rng, long_prompts + short_prompts)
        # the reference: each seeded request alone, target-only (no drafts), before any traffic
        expected = {i: (await generate(gateways[0].addr, ignore_eos=True, num_draft_tokens=0, **job))[0]
                    for i, job in enumerate(jobs) if job["seed"] is not None}

        async def stop_draft_soon() -> float:
            nonlocal draft_stopped
            await asyncio.sleep(0.3)
            await draft.stop()
            draft_stopped = True
            return loop.time()

        async def timed(run: Awaitable[tuple]) -> tuple:
            return (*await run, loop.time())

        loop = asyncio.get_running_loop()

        runs = [timed(generate(gateways[i % 2].addr, ignore_eos=True, num_draft_tokens=rng.randint(0, 8), **job))
                for i, job in enumerate(jobs)]
        *results, stopped_at = await asyncio.wait_for(asyncio.gather(*runs, stop_draft_soon()), timeout=120)
        outputs = [ids for ids, _, _, _ in results]              # an INTERNAL anywhere would have raised
        assert draft_stopped and sum(done > stopped_at for *_, done in results) >= 3    # streams outlived the draft
        assert sum(r[-1].usage.num_drafted_tokens for _, _, r, _ in results) > 0
        assert {i: outputs[i] for i in expected} == expected
        assert [len(ids) for ids in outputs] == [job["max_new_tokens"] for job in jobs]
        await wait_blocks_free(verifier)
        assert verifier.engine.block_manager.num_free_blocks == verifier.engine.block_manager.num_blocks
        assert len(verifier.engine.scheduler) == 0
    finally:
        for running in (*gateways, verifier) if draft_stopped else (*gateways, draft, verifier):
            await running.stop()
