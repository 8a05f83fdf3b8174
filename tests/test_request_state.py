"""RequestState: the one owner of a request's budget, output and finish (plain ints, no model)."""

from __future__ import annotations

from gateway.proposers.base import NO_DRAFT, Draft
from gateway.request_state import RequestState, RoundEvent
from protos.specmesh.v1 import common_pb2

EOS = 2


def _round(state: RequestState, tokens: list[int], drafted: int = 0, accepted: int = 0) -> list[int]:
    draft = Draft([5] * drafted, None, common_pb2.DRAFT_SOURCE_MODEL) if drafted else NO_DRAFT
    return state.on_round(RoundEvent(state.num_rounds + 1, draft, accepted, tokens, 0.0, 0.0, 0, 0))


def test_cuts_at_max_new_tokens_and_finishes_with_length() -> None:
    state = RequestState([1, 1], 5, frozenset({EOS}))
    assert state.on_first_token(7) == [7] and not state.finished
    assert _round(state, [8, 9, 10], drafted=3, accepted=2) == [8, 9, 10]
    assert state.draft_room() == 0                     # one token left: it comes from the target
    assert _round(state, [11, 12, 13], drafted=2, accepted=2) == [11]
    assert state.finish_reason == common_pb2.FINISH_REASON_LENGTH and state.num_emitted == 5
    assert state.output_ids == [7, 8, 9, 10, 11, 12, 13]        # every verified token, uncut
    assert (state.num_rounds, state.num_drafted, state.num_accepted) == (2, 5, 4)


def test_eos_ends_before_the_eos_token_unless_ignored() -> None:
    state = RequestState([1], 10, frozenset({EOS}))
    state.on_first_token(7)
    assert _round(state, [8, EOS, 9]) == [8]
    assert state.finish_reason == common_pb2.FINISH_REASON_STOP and state.num_emitted == 2
    ignoring = RequestState([1], 10, frozenset({EOS}), ignore_eos=True)
    ignoring.on_first_token(7)
    assert _round(ignoring, [8, EOS, 9]) == [8, EOS, 9] and not ignoring.finished


def test_stop_string_keeps_the_tokens_before_it() -> None:
    state = RequestState([1], 10)
    state.on_first_token(7)
    last = _round(state, [8, 9, 10])                   # 4 emitted; the stop string completed in the 3rd token
    assert state.stop_string(3, last) == [8, 9]
    assert state.finish_reason == common_pb2.FINISH_REASON_STOP_STRING and state.num_emitted == 3


def test_listeners_see_the_state_after_the_round() -> None:
    seen: list[list[int]] = []
    state = RequestState([1], 10)
    state.listeners.append(lambda event, s: seen.append(list(s.output_ids)))
    state.on_first_token(7)
    _round(state, [8, 9])
    assert seen == [[7, 8, 9]] and state.context_ids == [1, 7, 8, 9]
