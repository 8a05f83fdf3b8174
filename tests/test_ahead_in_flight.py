"""A verify whose drafts agree with the guesses of the ahead step now running does not stop that step
(verifier_service/engine.py `_ahead_serves`, verifier_service/ahead.py `agrees_with_guesses`): the step's tokens
settle it or verify its first drafts. Tiny verifier; the decision on a real session, the step's own record of its
guesses, and the output stays exact."""

from __future__ import annotations

from specmesh.engine.forward_cost import Fit
from specmesh.spec.sampling import SamplingParams
from tests.stack import start_verifier
from tests.test_decode_ahead import KV_CACHE, target_only, tokenizer, wait_ahead  # noqa: F401  (fixture)
from tests.test_e2e_greedy import wait_blocks_free

REPEATING = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2"


async def test_drafts_that_agree_with_the_steps_guesses_leave_it_running(tokenizer) -> None:  # noqa: F811
    verifier = await start_verifier(dtype="int8", block_size=4, decode_ahead_tokens=0, kv_cache_dtype=KV_CACHE)
    engine = verifier.engine
    try:
        prompt_ids = tokenizer(REPEATING)["input_ids"]
        want = await target_only(prompt_ids, 10)
        first = list((await engine.start_session("i", prompt_ids, SamplingParams(), max_new_tokens=10,
                                                 speculative=True).future).token_ids)
        assert first == want[:1]
        t = want[1:]                                         # the target's next tokens after what was delivered
        engine._ahead_in_flight = {"i": [t[0], t[1]]}        # as while a step with these two guesses runs
        assert engine._ahead_serves("i", [t[0], t[1], t[2]], None)     # agrees, goes further: the step helps
        assert engine._ahead_serves("i", [t[0]], None)                 # agrees, shorter
        assert not engine._ahead_serves("i", [t[0], t[1] + 1], None)   # disagrees where both go
        assert not engine._ahead_serves("i", [t[0], t[1]], [-1, 0])    # a tree: not judged here
        assert not engine._ahead_serves("j", [t[0]], None)             # no step for that session
        engine._ahead_in_flight = {}
        assert not engine._ahead_serves("i", [t[0]], None)             # nothing in flight
        output = first + list((await engine.verify("i", [t[0], t[1], t[2]], None).future).token_ids)
        while len(output) < 10:
            output += (await engine.verify("i", [], None).future).token_ids
        assert output[:10] == want
        engine.end_session("i")
        await wait_blocks_free(verifier)
    finally:
        await verifier.stop()


async def test_an_ahead_step_records_its_guesses_while_it_runs(tokenizer, monkeypatch) -> None:  # noqa: F811
    """The engine thread names each session's guesses for the forward it runs, and nothing once it is done (the
    tiny model's output never repeats, so prompt lookup is stood in for)."""
    monkeypatch.setattr("verifier_service.decode_ahead.guess", lambda context_ids, g, eos: [11] * g)
    verifier = await start_verifier(dtype="int8", block_size=4, decode_ahead_tokens=0, kv_cache_dtype=KV_CACHE)
    engine = verifier.engine
    seen: list[dict[str, list[int]]] = []
    forward = engine.runner.forward_flat

    def recording(items):                                    # type: ignore[no-untyped-def]
        seen.append(dict(engine._ahead_in_flight))
        return forward(items)

    engine.runner.forward_flat = recording
    try:
        engine.ahead.guesses = True
        engine.forward_cost.fit = lambda num_threads: Fit(0.0, 8, 0.0)      # as if rows were free on this CPU
        prompt_ids = tokenizer(REPEATING)["input_ids"]
        await engine.start_session("i", prompt_ids, SamplingParams(), max_new_tokens=12, speculative=True).future
        engine.ahead.max_tokens = 6
        engine.post(None)                                    # wake the engine thread: it decodes ahead
        await wait_ahead(engine, "i", len(prompt_ids) + 4)
        assert any(snapshot.get("i", [])[:1] == [11] for snapshot in seen), seen
        assert engine._ahead_in_flight == {}
        engine.end_session("i")
        await wait_blocks_free(verifier)
    finally:
        engine.runner.forward_flat = forward
        await verifier.stop()
