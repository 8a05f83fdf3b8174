"""Guesses in decode-ahead steps (specmesh/engine/guesses.py): the verifier fills an ahead forward's free rows
with prompt-lookup guesses for sessions that draft, and commits the ones the target confirms.

- On plain ints: how many tokens a forward may take at its measured cost, how rows are shared, guesses stop before
  an end of sequence.
- On a real verifier (tiny model; its random-weight output never repeats, so an oracle that knows target-only
  greedy's tokens and spoils some of them stands in for prompt lookup): right guesses are committed several per
  forward, wrong ones cut, the output stays target-only greedy, the ahead limit holds, a target-only session gets
  none, blocks are freed.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from specmesh.engine.forward_cost import UNKNOWN, Fit, ForwardCost
from specmesh.engine.guesses import MAX_GUESSES, GuessRate, best_num_guesses, guess
from specmesh.models import resolve_model_dir
from specmesh.spec.sampling import SamplingParams
from tests.stack import start_verifier
from tests.test_decode_ahead import KV_CACHE, ahead_metric, target_only, wait_ahead
from tests.test_e2e_greedy import PROMPTS, wait_blocks_free

X = 99


def test_guesses_are_priced_like_a_draft_length() -> None:
    vnni, avx2 = Fit(0.18, 1, 1.0), Fit(0.4, 4, 1.0)        # Zen 4 (~9 ms a token on 50) / Zen 3 (100 ms to 4 rows)
    assert best_num_guesses(0.5, UNKNOWN, 1, 7) == 1          # unmeasured: a quarter of a forward per row
    assert best_num_guesses(0.5, vnni, 1, 7) == 2             # 1.75 tokens for 1.36 forwards beats 1.5 for 1.18
    assert best_num_guesses(0.9, vnni, 1, 7) == 7             # a session whose guesses hit takes the most
    assert best_num_guesses(0.1, vnni, 1, 7) == 0             # and one whose guesses miss none
    assert best_num_guesses(0.1, avx2, 1, 7) == 3             # rows inside the free tile cost nothing
    assert best_num_guesses(0.1, avx2, 4, 7) == 0             # unless other sessions' tokens filled it
    assert best_num_guesses(0.9, vnni, 1, 2) == 2             # never past the room the caller leaves
    assert best_num_guesses(0.9, Fit(0.0, 2, 1.0), 1, 20) == MAX_GUESSES
    assert best_num_guesses(0.5, vnni, 8, 7) == 0             # beside 7 other rows: 8.5 tokens for 1.08x the forward
    assert best_num_guesses(0.9, vnni, 8, 7) >= 1             # a guess that nearly always hits still pays


def test_measured_forward_sizes_price_guesses_where_the_line_is_not_the_kernels_shape() -> None:
    """The int4 AVX-512 kernel on 2 threads: 68 ms for 8 rows, 82 for 9 (past its 8-row tile), 89 for 10. The line
    (about 5 ms a row) lets a guess that nearly always hits join 8 rows; the measured 9-row forwards do not."""
    cost = ForwardCost()
    for _ in range(20):
        for n, seconds in ((1, 0.042), (4, 0.052), (8, 0.068), (9, 0.082), (10, 0.089), (16, 0.121)):
            cost.observe(n, 2, seconds)
    fit = cost.fit(2)
    assert cost.seconds(2, 9) == pytest.approx(0.082) and cost.seconds(2, 5) is None and cost.seconds(1, 8) is None
    assert best_num_guesses(0.9, fit, 8, 7) >= 1                                   # by the line
    assert best_num_guesses(0.9, fit, 8, 7, lambda n: cost.seconds(2, n)) == 0     # by the measured sizes
    assert best_num_guesses(0.9, fit, 1, 7, lambda n: cost.seconds(2, n)) >= 1     # 1 row: 4 rows cost 1.24x


def test_the_guess_rate_follows_the_session_and_recovers() -> None:
    rate = GuessRate()
    assert rate.rate == 0.5
    for _ in range(20):
        rate.observe(4, 4)                  # all accepted
    assert rate.rate > 0.95
    for _ in range(40):
        rate.observe(3, 0)                  # the first one rejected: one try, no hit
    assert rate.rate < 0.15
    for _ in range(10):
        rate.observe(0, 0)                  # steps without guesses drift back toward the prior, slowly
    assert rate.rate < 0.15
    for _ in range(200):
        rate.observe(0, 0)
    assert 0.4 < rate.rate < 0.5


def test_guesses_come_from_the_context_and_stop_before_an_end_of_sequence() -> None:
    context = [1, 2, 3, 4, 7, 5, 1, 2, 3]
    assert guess(context, 4, eos_token_ids=()) == [4, 7, 5, 1]
    assert guess(context, 4, eos_token_ids={7}) == [4]
    assert guess(context, 0, eos_token_ids=()) == []
    assert guess([1, 2, 3], 4, eos_token_ids=()) == []               # nothing earlier to look up


# ---- a real verifier -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))


async def test_guesses_decode_several_tokens_per_ahead_step_and_stay_exact(tokenizer, monkeypatch) -> None:
    prompt_ids = tokenizer(PROMPTS[3])["input_ids"]
    n, max_new = len(prompt_ids), 60
    expected = await target_only(prompt_ids, max_new + 8)
    assert not {0, 2} & set(expected)        # the tiny target's ends of sequence: decoding ahead stops at one
    guessed_at: list[int] = []

    def oracle(context_ids: list[int], max_guesses: int, eos_token_ids: object) -> list[int]:
        pos = len(context_ids) - n             # output tokens so far: target-only's next ones, every other call spoilt
        guesses = expected[pos:pos + max_guesses]
        guessed_at.append(pos)
        return guesses[:-1] + [X] if len(guessed_at) % 2 and guesses else guesses

    monkeypatch.setattr("verifier_service.decode_ahead.guess", oracle)
    verifier = await start_verifier(dtype="int8", block_size=4, decode_ahead_tokens=6, kv_cache_dtype=KV_CACHE)
    engine = verifier.engine
    engine.ahead.guesses = True
    engine.forward_cost.fit = lambda num_threads: Fit(0.0, 8, 0.0)      # as if rows were free on this CPU
    try:
        output = list((await engine.start_session("g", prompt_ids, SamplingParams(), max_new_tokens=max_new)
                       .future).token_ids)
        while len(output) < max_new:
            # a caller that drafts (one wrong token: the verdict is the tokens decoded ahead, or one forward)
            await wait_ahead(engine, "g", min(n + len(output) + 1, n + max_new), timeout_s=20)
            held = len(engine.sessions["g"].seq.token_ids) - n - len(output)
            assert held <= 6                                             # the ahead limit holds with guesses
            output += (await engine.verify("g", [X], None).future).token_ids
        assert output[:max_new] == expected[:max_new]
        assert guessed_at and engine.ahead.counts.guessed > engine.ahead.counts.guess_accepted > len(guessed_at)
        assert ahead_metric(engine, "guess_accepted") == engine.ahead.counts.guess_accepted
        engine.end_session("g")
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()


@pytest.mark.parametrize("speculative", [False, True])
async def test_rounds_without_drafts_guess_only_for_a_speculative_session(tokenizer, monkeypatch,
                                                                          speculative: bool) -> None:
    """A target-only request (speculative False) gets plain target decoding; a request that drafts says so at the
    start, and its rounds without drafts (the gateway chose none) still guess while decoding ahead."""
    monkeypatch.setattr("verifier_service.decode_ahead.guess", lambda context_ids, g, eos: [11] * g)
    verifier = await start_verifier(dtype="int8", block_size=4, decode_ahead_tokens=6, kv_cache_dtype=KV_CACHE)
    engine = verifier.engine
    engine.ahead.guesses = True
    engine.forward_cost.fit = lambda num_threads: Fit(0.0, 8, 0.0)
    try:
        prompt_ids = tokenizer(PROMPTS[3])["input_ids"]
        n = len(prompt_ids)
        output = list((await engine.start_session("t", prompt_ids, SamplingParams(), max_new_tokens=30,
                                                  speculative=speculative).future).token_ids)
        while len(output) < 30:
            await wait_ahead(engine, "t", min(n + len(output) + 1, n + 30))     # idle steps decode ahead
            output += (await engine.verify("t", [], None).future).token_ids
        assert output[:30] == await target_only(prompt_ids, 30)
        assert engine.ahead.counts.decoded > 0 and (engine.ahead.counts.guessed > 0) == speculative
        engine.end_session("t")
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()
