"""The verifier's short wait for the sessions its last forward answered (verifier_service/gather.py), on plain floats,
and through the engine thread: concurrent streams end up sharing forwards instead of alternating in two groups."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from specmesh.models import resolve_model_dir
from specmesh.spec.sampling import SamplingParams
from tests.stack import reference_greedy, start_verifier
from tests.test_e2e_greedy import PROMPTS
from verifier_service.gather import SLACK, ReturnGather


def test_waits_for_a_session_expected_back_within_the_window() -> None:
    gather = ReturnGather(share=0.1, max_wait_s=0.02)
    gather.forward_done(["a", "b"], started=0.0, ended=0.1)             # window: 10 ms after the forward
    gather.returned("a", 0.104)                                          # a came back 4 ms after its answer
    gather.forward_done(["a"], started=0.2, ended=0.3)
    assert gather.wait_s(0.3) == pytest.approx(SLACK * 0.004)            # a is expected 4 ms (with slack) later
    assert gather.wait_s(0.3 + SLACK * 0.004) == 0.0                     # late: not waited for any longer
    gather.returned("a", 0.303)
    assert gather.wait_s(0.303) == 0.0                                   # back: nothing left to wait for


def test_never_waits_past_the_window_or_for_slow_or_unmeasured_sessions() -> None:
    gather = ReturnGather(share=0.1, max_wait_s=0.02)
    gather.forward_done(["fast", "slow"], started=0.0, ended=0.1)
    gather.returned("fast", 0.103)
    gather.returned("slow", 0.19)                                        # drafts with a model: 90 ms a return
    gather.forward_done(["fast", "slow", "new"], started=0.2, ended=1.2)   # a 1 s forward: window 20 ms (the cap)
    assert gather.wait_s(1.2) == pytest.approx(SLACK * 0.003)            # only the fast one is waited for
    gather.forget("fast")                                                # its session ended
    assert gather.wait_s(1.2) == 0.0
    gather.returned("slow", 1.29)
    gather.forward_done(["slow"], started=1.3, ended=1.301)              # a 1 ms forward: window 0.1 ms
    gather.returned("slow", 1.302)
    gather.forward_done(["slow"], started=1.31, ended=1.311)
    assert gather.wait_s(1.311) == 0.0                                   # expected after the window: no wait at all


def test_off_when_max_wait_is_zero() -> None:
    gather = ReturnGather(max_wait_s=0.0)
    gather.forward_done(["a"], 0.0, 0.1)
    gather.returned("a", 0.101)
    gather.forward_done(["a"], 0.2, 0.3)
    assert gather.wait_s(0.3) == 0.0


async def _stream(engine, session_id: str, prompt_ids: list[int], num_rounds: int) -> list[int]:  # noqa: ANN001
    """A caller that sends its next verify as soon as it has the answer (a target-only stream)."""
    output = list((await engine.start_session(session_id, prompt_ids, SamplingParams(), max_new_tokens=64).future)
                  .token_ids)
    for _ in range(num_rounds):
        output += (await engine.verify(session_id, [], None).future).token_ids
    engine.end_session(session_id)
    return output


@pytest.mark.parametrize("max_wait_s", [0.0, 0.05])
async def test_concurrent_streams_share_forwards_and_stay_exact(max_wait_s: float) -> None:
    """Four target-only streams on the tiny verifier. With a window that covers their return (the tiny model's
    forward takes a millisecond or two, so the test widens the share of it), nearly every forward carries all four:
    at most 1.5 forwards a round, where streams that alternate take up to four. The output is greedy's either way."""
    verifier = await start_verifier(block_size=4)
    engine = verifier.engine
    engine.gather.share, engine.gather.max_wait_s = 50.0, max_wait_s
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:4]]
    try:
        await asyncio.gather(*(_stream(engine, f"w{i}", p, 3) for i, p in enumerate(prompts)))  # measured returns
        steps, num_rounds = engine.num_steps, 20
        outputs = await asyncio.gather(*(_stream(engine, f"s{i}", p, num_rounds) for i, p in enumerate(prompts)))
        forwards = engine.num_steps - steps
    finally:
        await verifier.stop()
    assert outputs == [reference_greedy(p, num_rounds + 1) for p in prompts]
    if max_wait_s > 0:
        assert forwards <= 1.5 * (num_rounds + 1)
