"""What the API promises, through the full stack: a seeded sampled request gives the same tokens whatever the load,
draft length, drafting tier or timing (target-only included); repetition_penalty / logit_bias / min_p change the
output exactly as they change target-only decoding."""

from __future__ import annotations

import asyncio
import collections

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from specmesh.models import resolve_model_dir
from specmesh.ops import client
from specmesh.spec.logit_transforms import adjust_chain
from specmesh.spec.sampling import SamplingParams, logits_to_probs
from tests.chi_square import MIN_PVALUE_UNSEEDED, fit
from tests.stack import start_draft, start_gateway, start_verifier

PROMPT = "Once upon a time"
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack():
    verifier = await start_verifier(decode_ahead_tokens=4)
    same = await start_draft("tiny-draft")
    unrelated = await start_draft("tiny-draft-unrelated")
    gateways = {
        "plain": await start_gateway(verifier.addr, same.addr),
        # every drafting tier and timing-driven choice at once: cache, n-gram, trees, overlap, adaptive k
        "busy": await start_gateway(verifier.addr, unrelated.addr, enable_cache=True, enable_ngram=True,
                                    draft_tree_width=2, overlap=True, adaptive_draft_length=True),
        "suffix": await start_gateway(verifier.addr, same.addr, suffix_drafting=True, adaptive_draft_length=True),
        "draft-down": await start_gateway(verifier.addr, "127.0.0.1:1", draft_timeout_s=2.0),   # nothing listens
    }
    yield gateways
    for running in (*gateways.values(), same, unrelated, verifier):
        await running.stop()


async def tokens(addr: str, max_new_tokens: int = 24, **kwargs: object) -> list[int]:
    request = client.make_request(PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True, **kwargs)
    return [t async for r in client.stream(addr, request, timeout_s=120) for t in r.token_ids]


async def test_seeded_request_is_reproducible_under_load(stack) -> None:
    runs = [("plain", 0), ("plain", 3), ("busy", 5), ("busy", 8), ("suffix", 2), ("draft-down", 4)]
    outputs = []
    for i, (gateway, k) in enumerate(runs):
        background = [tokens(stack[g].addr, 32, temperature=1.0, seed=None if j % 2 else 50 + i + j,
                             num_draft_tokens=j + 1)
                      for j, g in enumerate(["busy", "plain", "suffix", "busy"])]
        background.append(tokens(stack["plain"].addr, 16, num_draft_tokens=4))                 # greedy beside it
        ours, *_ = await asyncio.gather(tokens(stack[gateway].addr, num_draft_tokens=k, **SEEDED), *background)
        outputs.append(ours)
    assert all(out == outputs[0] for out in outputs), outputs
    assert len(outputs[0]) == 24
    other = await tokens(stack["busy"].addr, num_draft_tokens=4, **{**SEEDED, "seed": 1235})
    assert other != outputs[0]


_MODEL: list[torch.nn.Module] = []


def target_logits(ids: list[int]) -> torch.Tensor:
    """The plain transformers model's last-position logits [1, V] (float32), independent of specmesh's engine."""
    if not _MODEL:
        path = str(resolve_model_dir("tiny-target"))
        _MODEL.append(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    with torch.inference_mode():
        return _MODEL[0](input_ids=torch.tensor([ids])).logits[:, -1]


def reference_greedy(prompt_ids: list[int], n: int, penalty: float, bias: dict[int, float]) -> list[int]:
    """Target-only greedy with transformers' RepetitionPenaltyLogitsProcessor, then the bias, then argmax."""
    ids = list(prompt_ids)
    for _ in range(n):
        logits = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), target_logits(ids))
        for token, b in bias.items():
            logits[0, token] += b
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


def prompt_ids() -> list[int]:
    return AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))(PROMPT)["input_ids"]


@pytest.mark.parametrize("bias", [{}, {7: 6.0, 11: -100.0}], ids=["penalty", "penalty+bias"])
async def test_greedy_with_repetition_penalty_equals_target_only(stack, bias: dict[int, float]) -> None:
    plain = await tokens(stack["plain"].addr, 20, num_draft_tokens=0)
    want = reference_greedy(prompt_ids(), 20, 1.5, bias)
    assert want != reference_greedy(prompt_ids(), 20, 1.0, {}) and plain != want     # the penalty changes it
    for gateway, k in (("plain", 0), ("plain", 4), ("busy", 6), ("suffix", 3)):
        got = await tokens(stack[gateway].addr, 20, num_draft_tokens=k, repetition_penalty=1.5, logit_bias=bias)
        assert got == want, (gateway, k)


async def test_logit_bias_forces_a_token(stack) -> None:
    assert await tokens(stack["plain"].addr, 8, num_draft_tokens=3, logit_bias={42: 100.0}) == [42] * 8


async def test_min_p_and_penalty_sampling_follows_the_transformed_target(stack) -> None:
    """Unseeded (rejection sampling against the draft's equally transformed q): the first token (prefill) and the
    second (a verify of 2 drafts, penalising the first token) follow the target-only transformed distribution."""
    params = SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.25)
    kwargs = {"temperature": 1.0, "min_p": 0.05, "repetition_penalty": 1.25, "num_draft_tokens": 2}
    pairs: list[list[int]] = []
    for _ in range(9):
        pairs += await asyncio.gather(*[tokens(stack["plain"].addr, 2, **kwargs) for _ in range(40)])
    ids = prompt_ids()

    def probs(context: list[int]) -> torch.Tensor:
        return logits_to_probs(adjust_chain(target_logits(context), params, context, []), params)[0]

    counts = collections.Counter(a for a, _ in pairs)
    first = torch.tensor([counts[t] for t in range(probs(ids).numel())], dtype=torch.float64)
    assert fit(first, probs(ids))[0] > MIN_PVALUE_UNSEEDED
    top = counts.most_common(1)[0][0]
    second = collections.Counter(b for a, b in pairs if a == top)
    p1 = probs(ids + [top])
    assert sum(second.values()) >= 60
    assert fit(torch.tensor([second[t] for t in range(p1.numel())], dtype=torch.float64), p1)[0] > MIN_PVALUE_UNSEEDED
