"""Invariant 2 through the full stack: sampled tokens follow the target's (processed) distribution exactly,
whether the drafts are accepted (identical draft) or mostly rejected (unrelated draft: residual resampling), for
unseeded requests (rejection sampling) and seeded ones (position-keyed Gumbel-max, specmesh/spec/seeded.py: one sample
per seed), and with the verifier decoding ahead (`same-ahead`: a token may come from an ahead step, and drafts meet
it first)."""

from __future__ import annotations

import asyncio
import collections

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specmesh.models import resolve_model_dir
from specmesh.ops import client
from specmesh.spec.sampling import SamplingParams, logits_to_probs
from tests.chi_square import MIN_PVALUE, MIN_PVALUE_UNSEEDED, fit
from tests.stack import start_draft, start_gateway, start_verifier

PROMPT = "The quick brown fox"
NUM_SAMPLES = 360
PARAMS = SamplingParams(temperature=1.0, top_k=4)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack():
    verifier = await start_verifier()
    ahead = await start_verifier(decode_ahead_tokens=8)      # the service default: sessions decode ahead while idle
    same = await start_draft("tiny-draft")
    unrelated = await start_draft("tiny-draft-unrelated")
    gateways = {"same": await start_gateway(verifier.addr, same.addr),
                "unrelated": await start_gateway(verifier.addr, unrelated.addr),
                "same-ahead": await start_gateway(ahead.addr, same.addr)}
    yield gateways
    for running in (*gateways.values(), same, unrelated, verifier, ahead):
        await running.stop()


@torch.inference_mode()
def target_probs(context_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("tiny-target")), dtype=torch.float32).eval()
    logits = model(input_ids=torch.tensor([context_ids])).logits[:, -1]
    return logits_to_probs(logits, PARAMS)[0]


async def sample_pairs(addr: str, seeded: bool = True) -> list[tuple[int, int]]:
    async def one(seed: int) -> tuple[int, int]:
        request = client.make_request(PROMPT, max_new_tokens=2, ignore_eos=True, temperature=PARAMS.temperature,
                                      top_k=PARAMS.top_k, seed=seed if seeded else None, num_draft_tokens=2)
        ids = [t async for r in client.stream(addr, request, timeout_s=60) for t in r.token_ids]
        return ids[0], ids[1]

    pairs: list[tuple[int, int]] = []
    for start in range(0, NUM_SAMPLES, 40):
        pairs += await asyncio.gather(*[one(seed) for seed in range(start, start + 40)])
    return pairs


def assert_follows(samples: list[int], probs: torch.Tensor, seeded: bool = True) -> None:
    support = set(torch.nonzero(probs).flatten().tolist())
    assert set(samples) <= support, f"sampled outside the target's support: {set(samples) - support}"
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    pvalue, tv = fit(counts, probs)
    assert pvalue > (MIN_PVALUE if seeded else MIN_PVALUE_UNSEEDED), (pvalue, tv)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("draft", ["same", "unrelated", "same-ahead"])
async def test_sampled_tokens_follow_the_target_distribution(stack, draft: str, seeded: bool) -> None:
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    prompt_ids = tok(PROMPT)["input_ids"]
    pairs = await sample_pairs(stack[draft].addr, seeded)
    assert_follows([a for a, _ in pairs], target_probs(prompt_ids), seeded)          # from the prefill
    first = collections.Counter(a for a, _ in pairs).most_common(1)[0][0]
    second = [b for a, b in pairs if a == first]                             # from a verify round with drafts
    assert len(second) >= 60
    assert_follows(second, target_probs(prompt_ids + [first]), seeded)
