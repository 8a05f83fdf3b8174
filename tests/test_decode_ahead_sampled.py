"""Decoding ahead for sampled sessions (verifier_service/decode_ahead.py `may_decode_ahead`): a seeded session's
ahead tokens are its seeded draws (its output equals the same seed's target-only output); an unseeded one's are draws
from p (chi-square against transformers' distribution), and it stops decoding ahead after a verify of model drafts."""

from __future__ import annotations

import asyncio
import collections

import pytest
from transformers import AutoTokenizer

from specmesh.models import resolve_model_dir
from specmesh.spec.rejection import SparseDist
from specmesh.spec.sampling import SamplingParams
from tests.stack import start_verifier
from tests.test_decode_ahead import KV_CACHE, D, X, target_only, wait_ahead
from tests.test_e2e_greedy import PROMPTS, wait_blocks_free
from tests.test_sampling_e2e import assert_follows, target_probs


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))

async def test_seeded_sessions_decode_ahead_and_keep_their_seeded_tokens(tokenizer) -> None:
    """A seeded session's ahead tokens are its seeded draws: the output equals the same seed's target-only output."""
    params = SamplingParams(temperature=1.0, top_k=8, seed=7)
    prompt_ids = tokenizer(PROMPTS[0])["input_ids"]
    verifier = await start_verifier(dtype="int8", block_size=4, decode_ahead_tokens=4, kv_cache_dtype=KV_CACHE)
    engine = verifier.engine
    try:
        output = list((await engine.start_session("r", prompt_ids, params, max_new_tokens=16).future).token_ids)
        while len(output) < 16:
            await wait_ahead(engine, "r", len(prompt_ids) + len(output) + 1)
            output += (await engine.verify("r", [], None).future).token_ids
        assert engine.ahead.counts.delivered >= 8
        engine.end_session("r")
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()
    assert output == await target_only(prompt_ids, 16, params)


async def test_unseeded_sampled_sessions_decode_ahead_until_they_verify_model_drafts(tokenizer) -> None:
    """An unseeded sampled session decodes ahead while its verifies carry no draft model block; after one that does,
    it waits for the next verify (an ahead token would lower the model drafts' acceptance); one without model drafts
    lets it decode ahead again."""
    params = SamplingParams(temperature=1.0, top_k=8)
    prompt_ids = tokenizer(PROMPTS[0])["input_ids"]
    n = len(prompt_ids)
    verifier = await start_verifier(dtype="int8", block_size=4, decode_ahead_tokens=3, kv_cache_dtype=KV_CACHE)
    engine = verifier.engine
    try:
        output = list((await engine.start_session("u", prompt_ids, params, max_new_tokens=40).future).token_ids)
        await wait_ahead(engine, "u", n + 1 + 3)
        output += (await engine.verify("u", [], None).future).token_ids       # 1 + 3 ahead tokens
        assert len(output) == 4
        await wait_ahead(engine, "u", n + len(output) + 3)
        ahead = engine.sessions["u"].seq.token_ids[n + len(output):]
        # model drafts: three meet the ahead tokens (equal: accepted), the fourth is verified in a forward by
        # rejection sampling with its own q
        dists = [SparseDist((t,), (1.0,)) for t in ahead] + [SparseDist((X, D), (0.5, 0.5))]
        steps = engine.num_steps
        reply = await engine.verify("u", [*ahead, X], dists, model_drafts=True).future
        assert engine.num_steps == steps + 1 and reply.token_ids[:3] == ahead and reply.num_accepted >= 3
        output += reply.token_ids
        await asyncio.sleep(0.3)
        assert len(engine.sessions["u"].seq.token_ids) == n + len(output)      # nothing ahead after model drafts
        output += (await engine.verify("u", [], None).future).token_ids
        await wait_ahead(engine, "u", n + len(output) + 3)                     # undrafted: ahead again
        engine.end_session("u")
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()


async def test_unseeded_tokens_decoded_ahead_follow_the_target_distribution(tokenizer) -> None:
    """The first token an unseeded session decodes ahead is a draw from p given the context (chi-square over 360
    sessions against transformers' distribution, top_k = 4)."""
    params = SamplingParams(temperature=1.0, top_k=4)
    prompt_ids = tokenizer(PROMPTS[0])["input_ids"]
    n = len(prompt_ids)
    verifier = await start_verifier(decode_ahead_tokens=1)
    engine = verifier.engine

    async def pair(i: int) -> tuple[int, int]:
        first = (await engine.start_session(f"d{i}", prompt_ids, params, max_new_tokens=2).future).token_ids[0]
        await wait_ahead(engine, f"d{i}", n + 2, timeout_s=30)
        second = engine.sessions[f"d{i}"].seq.token_ids[n + 1]
        engine.end_session(f"d{i}")
        return first, second

    try:
        pairs: list[tuple[int, int]] = []
        for start in range(0, 360, 40):
            pairs += await asyncio.gather(*[pair(i) for i in range(start, start + 40)])
        assert engine.ahead.counts.decoded == 360
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()
    first = collections.Counter(a for a, _ in pairs).most_common(1)[0][0]
    second = [b for a, b in pairs if a == first]
    assert len(second) >= 60
    assert_follows(second, target_probs(prompt_ids + [first]), seeded=False)   # (its PARAMS: these)
