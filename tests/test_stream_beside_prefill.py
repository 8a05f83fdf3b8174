"""Issue 27 end to end on the tiny verifier: a decoding session keeps getting its verifies answered, one per step,
while a near-context prompt prefills in chunks beside it; outputs stay exact (greedy == target-only), and the
metrics and step spans say what each step carried and how long the stream waited behind prefill.

The engine thread is stopped and the test runs each step itself, so it counts steps, never seconds."""

from __future__ import annotations

import asyncio
import os
import random

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specmesh.spec.sampling import SamplingParams
from specmesh.telemetry.tracing import add_exporter
from tests.stack import reference_greedy, start_verifier
from tests.test_paged_verifier import handle_posted

MAX_MODEL_LEN = 256
STEP_BUDGET = 64
LONG_PROMPT = 240            # near the context limit: several chunks of the step budget
STREAM_TOKENS = 160


async def answered(completion) -> list[int]:
    """The tokens of a completion the engine resolved in the step just run (its callback runs on this loop)."""
    await asyncio.sleep(0)
    assert completion.future.done(), "the request was not answered in this step"
    return list(completion.future.result().token_ids)


def sample(engine, name: str, labels: dict[str, str] | None = None) -> float:
    return engine.metrics.registry.get_sample_value(name, labels or {}) or 0.0


async def test_a_stream_is_answered_every_step_while_a_near_context_prompt_prefills() -> None:
    memory = InMemorySpanExporter()
    add_exporter(memory, "specmesh-test", batch=False)
    verifier = await start_verifier(max_num_batched_tokens=STEP_BUDGET, max_model_len=MAX_MODEL_LEN, block_size=8)
    engine = verifier.engine
    engine.stop()                        # the test runs the steps
    try:
        rng = random.Random(27)
        stream_prompt = [rng.randrange(10, 500) for _ in range(12)]
        long_prompt = [rng.randrange(10, 500) for _ in range(LONG_PROMPT)]
        expected = reference_greedy(stream_prompt, STREAM_TOKENS)
        greedy = SamplingParams()
        start = engine.start_session("stream", stream_prompt, greedy)
        handle_posted(engine, 1)
        engine.step()
        tokens = await answered(start)
        for _ in range(3):               # a few plain decode steps: the engine measures what a step costs
            verify = engine.verify("stream", [], None)
            handle_posted(engine, 1)
            engine.step()
            tokens += await answered(verify)
        prefill_before = sample(engine, "specmesh_engine_step_tokens_sum", {"kind": "prefill"})
        waits_before = sample(engine, "specmesh_engine_prefill_wait_seconds_count")
        memory.clear()

        first = engine.start_session("long", long_prompt, greedy)
        handle_posted(engine, 1)
        long_seq = engine.sessions["long"].seq
        steps = 0
        while not first.future.done():
            n = len(tokens)
            drafts = expected[n:n + 2] if steps % 2 == 0 else [(expected[n] + 1) % 512]      # accepted / rejected
            verify = engine.verify("stream", drafts, None)
            if steps % 3 == 2:           # the verify arrives while a prefill-only step runs: it waits behind it
                computed = long_seq.num_computed
                engine.step()
                assert long_seq.num_computed > computed
            handle_posted(engine, 1)
            computed = long_seq.num_computed
            engine.step()
            tokens += await answered(verify)                  # the stream got its verify answered in this step
            assert long_seq.num_computed > computed or first.future.done()   # and the prompt progressed
            steps += 1
            assert steps < LONG_PROMPT and len(tokens) < STREAM_TOKENS - 4
        assert steps >= LONG_PROMPT // STEP_BUDGET
        assert tokens == expected[:len(tokens)]                                       # exact beside the prefill
        assert list(first.future.result().token_ids) == reference_greedy(long_prompt, 1)

        # Metrics: the prompt's tokens ran as prefill (but its last block, a decode), the stream's verifies were
        # observed as decode requests, and the ones that arrived during a prefill-only step waited behind it.
        prefill = sample(engine, "specmesh_engine_step_tokens_sum", {"kind": "prefill"}) - prefill_before
        assert LONG_PROMPT - 8 <= prefill <= LONG_PROMPT     # (all of it when the last chunk ran whole)
        assert sample(engine, "specmesh_engine_step_tokens_sum", {"kind": "decode"}) >= steps
        assert sample(engine, "specmesh_engine_prefill_wait_seconds_count") - waits_before >= steps
        assert sample(engine, "specmesh_engine_prefill_wait_seconds_sum") > 0
        # Step spans carry the composition, the time bound and the longest wait behind prefill ...
        forwards = [s for s in memory.get_finished_spans() if s.name == "verifier-engine forward"]
        mixed = [a for a in (s.attributes for s in forwards)
                 if a["specmesh.batch.num_decode_tokens"] and a["specmesh.batch.num_prefill_tokens"]]
        assert len(mixed) >= steps // 2
        assert all(a["specmesh.step.time_bound_s"] > 0 for a in mixed)
        assert all(0 < a["specmesh.step.estimated_s"] <= a["specmesh.step.time_bound_s"] for a in mixed)
        assert max(a["specmesh.step.max_prefill_wait_s"] for a in mixed) > 0
        # ... and how long their compute threads waited for a core (Linux schedstat), also a counter.
        if os.path.exists("/proc/self/schedstat"):
            assert all(a["specmesh.step.cpu_wait_s"] >= 0 for a in mixed)
            assert engine.metrics.registry.get_sample_value("specmesh_engine_cpu_wait_seconds_total") is not None
    finally:
        engine.scheduler.clear()
        await verifier.stop()


async def test_an_idle_greedy_stream_decodes_ahead_beside_the_prefill() -> None:
    """With decoding ahead on, a stream between two verifies gets a target token ahead in every step that carries
    the long prompt's chunks (up to the ahead limit); its next verify is settled by them without a forward."""
    verifier = await start_verifier(max_num_batched_tokens=STEP_BUDGET, max_model_len=MAX_MODEL_LEN, block_size=8,
                                    decode_ahead_tokens=4)
    engine = verifier.engine
    engine.stop()
    try:
        rng = random.Random(28)
        stream_prompt = [rng.randrange(10, 500) for _ in range(12)]
        long_prompt = [rng.randrange(10, 500) for _ in range(LONG_PROMPT)]
        expected = reference_greedy(stream_prompt, 16)
        start = engine.start_session("stream", stream_prompt, SamplingParams())
        handle_posted(engine, 1)
        engine.step()
        assert await answered(start) == expected[:1]
        stream = engine.sessions["stream"]
        first = engine.start_session("long", long_prompt, SamplingParams())
        handle_posted(engine, 1)
        long_seq = engine.sessions["long"].seq
        for ahead in range(1, 5):                        # each step: a prompt chunk and one token ahead
            computed = long_seq.num_computed
            engine.step()
            assert long_seq.num_computed > computed and not first.future.done()
            assert stream.seq.token_ids[len(stream_prompt):] == expected[:1 + ahead]
        computed = long_seq.num_computed
        engine.step()                                    # at the ahead limit: the prompt's chunk alone
        assert long_seq.num_computed > computed and len(stream.seq.token_ids) == len(stream_prompt) + 5
        verify = engine.verify("stream", [(expected[1] + 1) % 512], None)      # a wrong draft: settled at once
        handle_posted(engine, 1)
        assert await answered(verify) == expected[1:5]
        while not first.future.done():
            engine.step()
            await asyncio.sleep(0)
        assert list(first.future.result().token_ids) == reference_greedy(long_prompt, 1)
        assert stream.seq.token_ids[len(stream_prompt):] == expected[:len(stream.seq.token_ids) - 12]
    finally:
        engine.scheduler.clear()
        await verifier.stop()
