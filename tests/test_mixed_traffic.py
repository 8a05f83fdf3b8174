"""Issue 12 end to end: prompts near the context limit (prefilled in chunks over a small step budget) beside many
short drafted streams with random draft lengths, and a few cancels, on a float32 verifier and on an int8 one over
the half KV cache. No request fails, greedy outputs equal target-only greedy decoding, and every KV block comes
back. Also: a fault in one draft session stays there."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from transformers import AutoTokenizer

from protos.specmesh.v1 import generate_pb2_grpc
from specmesh.engine.errors import EngineError
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from specmesh.spec.sampling import SamplingParams
from tests.stack import reference_greedy, start_draft, start_gateway, start_verifier
from tests.test_e2e_greedy import PROMPTS, generate, wait_blocks_free

MAX_MODEL_LEN = 256
STEP_BUDGET = 64
WORDS = ("cache", "block", "token", "draft", "verify", "paged", "kernel", "river", "stone", "light", "graph", "queue")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))


def near_context_prompt(tokenizer, rng: random.Random, preamble: str, max_tokens: int) -> str:
    """The longest run of random words after `preamble` that still tokenizes to at most `max_tokens`."""
    text = preamble
    while True:
        longer = text + " " + rng.choice(WORDS)
        if len(tokenizer(longer)["input_ids"]) > max_tokens:
            return text
        text = longer


async def cancel_after_first_token(addr: str, prompt: str, max_new_tokens: int) -> None:
    request = client.make_request(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, num_draft_tokens=8)
    async with grpc.aio.insecure_channel(addr) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(request)
        async for _ in call:
            break
        call.cancel()


async def quantized_target_only(jobs: list[tuple[list[int], int]], **engine: object) -> list[list[int]]:
    """Greedy target-only decoding of each (prompt ids, n) alone, one token a forward, on a verifier of its own built
    like the one under test (the same quantized numerics and KV cache type)."""
    verifier = await start_verifier(decode_ahead_tokens=0, **engine)
    try:
        outputs = []
        for i, (prompt_ids, n) in enumerate(jobs):
            output = list((await verifier.engine.start_session(f"ref{i}", prompt_ids, SamplingParams()).future)
                          .token_ids)
            while len(output) < n:
                output += (await verifier.engine.verify(f"ref{i}", [], None).future).token_ids
            verifier.engine.end_session(f"ref{i}")
            outputs.append(output[:n])
        return outputs
    finally:
        await verifier.stop()


@pytest.mark.parametrize("numerics", [{}, {"dtype": "int8", "kv_cache_dtype": "float16"}],
                         ids=["float32", "int8-half-cache"])
async def test_near_context_prefills_beside_drafted_streams(tokenizer, numerics: dict[str, str]) -> None:
    """float32: outputs equal transformers' greedy decoding. int8 on the default half KV cache (what a quantized
    verifier runs out of the box): outputs equal that verifier's own target-only greedy decoding, each prompt alone,
    though here the long prompts are prefilled in chunks beside streams drafted in blocks of random k."""
    rng = random.Random(12)
    preamble = " ".join(rng.choice(WORDS) for _ in range(60))      # shared: prefix-cache hits between them
    long_jobs = [(near_context_prompt(tokenizer, rng, preamble, MAX_MODEL_LEN - 20 - i), 16 + i) for i in range(3)]
    short_jobs = [(PROMPTS[i % len(PROMPTS)] + " " + rng.choice(WORDS), rng.randint(12, 40)) for i in range(12)]
    jobs = long_jobs + short_jobs
    assert all(len(tokenizer(p)["input_ids"]) > 3 * STEP_BUDGET for p, _ in long_jobs)
    if numerics:
        expected = await quantized_target_only([(tokenizer(p)["input_ids"], n) for p, n in jobs],
                                               max_model_len=MAX_MODEL_LEN, block_size=8, **numerics)
    else:
        expected = [reference_greedy(tokenizer(p)["input_ids"], n) for p, n in jobs]
    verifier = await start_verifier(max_num_batched_tokens=STEP_BUDGET, max_model_len=MAX_MODEL_LEN, block_size=8,
                                    decode_ahead_tokens=8, **numerics)
    same, unrelated = await start_draft("tiny-draft"), await start_draft("tiny-draft-unrelated")
    gateways = [await start_gateway(verifier.addr, same.addr), await start_gateway(verifier.addr, unrelated.addr),
                # the shipped drafting: suffix drafting's choice, its draft prefill after the verifier's, the load term
                await start_gateway(verifier.addr, same.addr, suffix_drafting=True, enable_cache=True,
                                    draft_host_share=0.5)]
    try:
        runs = [generate(gateways[i % 3].addr, p, max_new_tokens=n, ignore_eos=True,
                         num_draft_tokens=rng.randint(0, 16)) for i, (p, n) in enumerate(jobs)]
        cancels = [cancel_after_first_token(gateways[0].addr, long_jobs[0][0], 20),
                   cancel_after_first_token(gateways[1].addr, PROMPTS[2], 200)]
        results = await asyncio.wait_for(asyncio.gather(*runs, *cancels), timeout=120)
        outputs = [ids for ids, _, _ in results[: len(jobs)]]
        assert outputs == expected                  # an INTERNAL anywhere would have raised from generate()
        assert sum(r[-1].usage.num_drafted_tokens for _, _, r in results[: len(jobs)]) > 0
        await wait_blocks_free(verifier)
        assert verifier.engine.block_manager.num_free_blocks == verifier.engine.block_manager.num_blocks
        assert len(verifier.engine.scheduler) == 0
    finally:
        for running in (*gateways, same, unrelated, verifier):
            await running.stop()


async def test_a_draft_fault_fails_only_its_proposal() -> None:
    """The draft engine isolates faults the same way: one session's bug is INTERNAL for its caller only, the other
    session's proposal is answered in the same steps, and the faulty session drafts again on its next call."""
    running = await start_draft("tiny-draft", draft_ahead=False)
    engine = running.engine
    try:
        real_sample = engine._sample
        broken = {"bad"}

        def sample(proposal, logits):
            if proposal.session.session_id in broken:
                raise RuntimeError("boom")
            return real_sample(proposal, logits)

        engine._sample = sample
        context = list(range(10, 40))
        calls = [engine.propose(sid, len(context), context, 4, SamplingParams(), 32) for sid in ("bad", "good")]
        with pytest.raises(EngineError) as info:
            await calls[0].future
        assert info.value.code == "INTERNAL" and "boom" in str(info.value)
        good = (await calls[1].future).draft_ids
        assert len(good) == 4
        broken.clear()
        again = await engine.propose("bad", len(context), [], 4, SamplingParams(), 32).future
        assert again.draft_ids == good                  # same model, same context: the same greedy drafts
    finally:
        await running.stop()
