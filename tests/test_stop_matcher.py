"""Tests for gateway.text_stream.StopMatcher: stop strings found across arbitrarily cut text pieces."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.text_stream import StopMatcher

HYPO = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _feed_all(matcher: StopMatcher, pieces: Sequence[str]) -> tuple[list[str], bool]:
    outs: list[str] = []
    stopped = False
    for piece in pieces:
        out, stopped = matcher.feed(piece)
        outs.append(out)
        if stopped:
            break
    return outs, stopped


def test_stop_in_single_piece() -> None:
    outs, stopped = _feed_all(StopMatcher(["STOP"]), ["Hello STOP there"])
    assert stopped and outs == ["Hello "]


def test_stop_split_across_many_pieces() -> None:
    outs, stopped = _feed_all(StopMatcher(["STOP"]), ["ab", "cS", "T", "O", "Pxyz", "more"])
    assert stopped
    assert outs == ["ab", "c", "", "", ""]


def test_earliest_of_multiple_stop_strings_wins() -> None:
    outs, stopped = _feed_all(StopMatcher(["\n\n", "END"]), ["foo E", "ND bar\n\n"])
    assert stopped and "".join(outs) == "foo "


def test_stop_that_is_prefix_of_longer_stop() -> None:
    outs, stopped = _feed_all(StopMatcher(["foobar", "foo"]), ["x", "fo", "o", "bar"])
    assert stopped and "".join(outs) == "x"


def test_shorter_stop_inside_held_prefix_of_longer_stop() -> None:
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.feed("xab") == ("x", False)
    assert matcher.feed("c") == ("a", True)


def test_held_text_released_when_it_diverges_or_on_flush() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("hello ST") == ("hello ", False)
    assert matcher.feed("AR") == ("STAR", False)
    assert matcher.feed(" ST") == (" ", False)
    assert matcher.flush() == "ST"


def test_after_stop_nothing_more_is_emitted() -> None:
    matcher = StopMatcher(["!"])
    assert matcher.feed("hi! there") == ("hi", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_no_stop_strings_passes_everything_through() -> None:
    matcher = StopMatcher(["", ""])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


@given(
    text=st.text(alphabet="abc\n", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
)
@HYPO
def test_stop_matcher_matches_reference(text: str, cuts: list[int], stops: list[str]) -> None:
    """Streaming semantics: generation ends at the first piece after which some stop string has appeared; the output
    is the text before the earliest stop string seen by then (a longer stop that would have started earlier but is
    not complete yet never completes: nothing is generated after the stop)."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    hits: list[int] = []
    for end in bounds:
        hits = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if hits:
            break
    expected = text[: min(hits)] if hits else text
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    matcher = StopMatcher(stops)
    emitted = ""
    stopped = False
    for piece in pieces:
        out, stopped = matcher.feed(piece)
        emitted += out
        assert expected.startswith(emitted)
        if stopped:
            break
    if not stopped:
        emitted += matcher.flush()
    assert stopped == bool(hits)
    assert emitted == expected
