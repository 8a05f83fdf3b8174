"""Prompt-lookup guesses in draft forwards (draft_service/engine.py, specmesh/engine/guesses.py): a greedy session's
draft forward also runs guesses of its next tokens, and every guess equal to the draft's argmax is a draft token without
a forward of its own.

The tiny draft's random-weight output never repeats itself, so an oracle that knows its greedy drafts (and spoils
every other call's last guess) stands in for prompt lookup: the drafts are the same as without guesses (int8 numerics
are batch-invariant), in fewer forwards; sampled sessions never guess.
"""

from __future__ import annotations

from specmesh.engine.forward_cost import Fit
from specmesh.spec.sampling import SamplingParams
from tests.stack import start_draft

CONTEXT = [(7 * i + 3) % 200 + 10 for i in range(60)]
X = 499


async def drafts_of(engine, session_id: str, k: int,
                    params: SamplingParams = SamplingParams()) -> tuple[list[int], int]:
    steps = engine.num_steps
    drafts = await engine.propose(session_id, len(CONTEXT), CONTEXT, k, params, 32).future
    return drafts.draft_ids, engine.num_steps - steps


async def test_guessed_drafts_are_the_drafts_in_fewer_forwards(monkeypatch) -> None:
    running = await start_draft("tiny-draft", draft_ahead=False, dtype="int8")
    engine = running.engine
    try:
        engine.guesses = False
        expected, plain_steps = await drafts_of(engine, "plain", 12)
        calls: list[int] = []

        def oracle(context_ids: list[int], max_guesses: int, eos_token_ids: object) -> list[int]:
            pos = len(context_ids) - len(CONTEXT)
            guesses = expected[pos:pos + max_guesses]
            calls.append(pos)
            return guesses[:-1] + [X] if len(calls) % 2 and guesses else guesses

        monkeypatch.setattr("draft_service.engine.guess", oracle)
        engine.guesses = True
        engine.forward_cost.fit = lambda num_threads: Fit(0.0, 8, 0.0)      # rows free: guess all that is left
        drafts, guessed_steps = await drafts_of(engine, "guessed", 12)
        assert drafts == expected
        assert calls and engine.num_guesses_accepted > 0 and guessed_steps < plain_steps
        assert engine.num_guessed > engine.num_guesses_accepted        # the spoilt guesses were cut
        accepted = engine.metrics.registry.get_sample_value("specmesh_draft_guess_accepted_total")
        assert accepted == engine.num_guesses_accepted
    finally:
        await running.stop()


async def test_sampled_sessions_never_guess(monkeypatch) -> None:
    running = await start_draft("tiny-draft", draft_ahead=False, dtype="int8")
    engine = running.engine
    try:
        monkeypatch.setattr("draft_service.engine.guess", lambda *args: [11, 12, 13])
        engine.forward_cost.fit = lambda num_threads: Fit(0.0, 8, 0.0)
        drafts, steps = await drafts_of(engine, "s", 6, SamplingParams(temperature=1.0, seed=3))
        assert len(drafts) == 6 and steps >= 6 and engine.num_guessed == 0
    finally:
        await running.stop()
