"""Suffix drafting through the full tiny stack: no round waits for the draft service's prefill of a long prompt.

A Propose for nothing (a prefill) is answered as soon as the draft service holds the context, while its compute goes
on. The gateway took that answer as "prefilled" and offered the model, and the model round then waited behind the
whole draft prefill: on the real pair a ~3,900-token document froze its own stream for 30 s, until the round's
Propose failed with DEADLINE_EXCEEDED. Now the suffix path's prefill is answered once computed (ModelDrafter.sync),
and the rounds before that draft without the model."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from transformers import AutoTokenizer

from protos.specmesh.v1 import common_pb2
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from tests.stack import reference_greedy, slow_forwards, start_draft, start_gateway, start_verifier

PROMPT = "Once upon a time, in a city on a high valley, " * 20     # 660 tokens: two prefill chunks of the draft
CHUNK_S = 0.8                                                      # each of them this much slower


def slow_prompt_chunks(monkeypatch: pytest.MonkeyPatch, runner: Any, prompt_len: int) -> None:
    """The draft's forwards of prompt chunks (not its catch-ups or drafts) take CHUNK_S longer."""
    forward_flat = runner.forward_flat

    def slow(items: Any, *args: Any, **kwargs: Any) -> Any:
        if any(item.start_pos < prompt_len and len(item.token_ids) > 64 for item in items):
            time.sleep(CHUNK_S)
        return forward_flat(items, *args, **kwargs)
    monkeypatch.setattr(runner, "forward_flat", slow)


async def test_no_round_waits_for_the_draft_prefill_and_the_model_drafts_once_it_is_done(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    verifier = await start_verifier(decode_ahead_tokens=8)
    draft = await start_draft()
    slow_prompt_chunks(monkeypatch, draft.engine.runner, len(prompt_ids))
    slow_forwards(monkeypatch, verifier.engine.runner, 0.01)        # the stream outlasts the draft prefill
    gateway = await start_gateway(verifier.addr, draft.addr, suffix_drafting=True, draft_timeout_s=5.0)
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.proposers.draft_model"):
            started, times, responses = time.perf_counter(), [], []
            async for r in client.stream(gateway.addr, client.make_request(PROMPT, max_new_tokens=300,
                                                                           ignore_eos=True), timeout_s=120):
                times.append(time.perf_counter() - started)
                responses.append(r)
        ids = [t for r in responses for t in r.token_ids]
        assert ids == reference_greedy(prompt_ids, 300)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert max(gaps) < CHUNK_S, max(gaps)                       # the draft prefill takes 2 x CHUNK_S
        model_rounds = [i for i, r in enumerate(responses)
                        if r.round.draft_source == common_pb2.DRAFT_SOURCE_MODEL and r.round.num_drafted]
        assert model_rounds and times[model_rounds[0]] > 2 * CHUNK_S    # the model drafts, once it holds the KV
        assert "draft service failed" not in caplog.text
    finally:
        await gateway.stop()
        await draft.stop()
        await verifier.stop()
