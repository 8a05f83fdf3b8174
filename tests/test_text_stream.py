"""Tests for gateway.text_stream: UTF-8-safe incremental detokenization and stop strings."""

from __future__ import annotations

import string
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.text_stream import IncrementalDetokenizer, TextStream

PERSIAN = "سلام، امروز هوا چطور است؟"
EMOJI = "🍕🚀 👍🏽 👨‍👩‍👧"
MIXED = "Hello دنیا 🌍! Today is خوب 😀, isn't it?"
SAMPLES = (PERSIAN, EMOJI, MIXED, "plain ascii text.")

HYPO = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------ tokenizers


def _training_corpus() -> Iterator[str]:
    english = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, how are you today? i am fine, thanks!",
        "speculative decoding makes large language models faster",
        "this is a test of the tokenizer training pipeline.",
    ]
    # Mostly English so the ~300-entry vocab spends its merges there and Persian
    # characters / emoji stay split over several byte tokens.
    yield from english * 30
    yield from ["کتاب", "سلام 🍕", "🚀"]


def _bytelevel_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")


def _sentencepiece_model() -> models.BPE:
    """Llama-style BPE: ``▁`` word marker, letters, byte-fallback tokens for the rest."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", *string.ascii_letters, *",.?!'"]
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("l", "l"), ("▁", "w"), ("o", "r")]
    pieces += ["".join(m) for m in merges]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    return models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")


def _sentencepiece_tokenizer(decoder: decoders.Decoder) -> PreTrainedTokenizerFast:
    tok = Tokenizer(_sentencepiece_model())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _llama_style_tokenizer() -> PreTrainedTokenizerFast:
    decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _sentencepiece_tokenizer(decoder)


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    return _sentencepiece_tokenizer(decoders.Metaspace())


def _wordpiece_cleanup_tokenizer() -> PreTrainedTokenizerFast:
    """Decoder outside the window whitelist + ``clean_up_tokenization``: full-decode path."""
    words = ["[UNK]", "[SEP]", "do", "n", "'", "t", "s", "m", "ve", "re", ".", ",", "?", "!"]
    words += ["hello", "world", "##s", "##ing", "go", "it", "i", "a"]
    tok = Tokenizer(models.WordPiece(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", clean_up_tokenization_spaces=True
    )


BYTELEVEL = _bytelevel_tokenizer()
LLAMA = _llama_style_tokenizer()
METASPACE = _metaspace_tokenizer()
WORDPIECE = _wordpiece_cleanup_tokenizer()
ALL_TOKENIZERS = {"bytelevel": BYTELEVEL, "llama": LLAMA, "metaspace": METASPACE, "wordpiece": WORDPIECE}
UTF8_TOKENIZERS = {"bytelevel": BYTELEVEL, "llama": LLAMA}  # round-trip arbitrary unicode


def _decode(tokenizer: PreTrainedTokenizerFast, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _is_byte_token(tokenizer: PreTrainedTokenizerFast, token_id: int) -> bool:
    """Byte-fallback groups are only final once a non-byte token follows them."""
    return tokenizer.convert_ids_to_tokens(token_id).startswith("<0x")


def _chunks(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    out, pos, i = [], 0, 0
    while pos < len(ids):
        size = sizes[i % len(sizes)] if sizes else 1
        out.append(list(ids[pos : pos + size]))
        pos, i = pos + size, i + 1
    return out


def _stream(tokenizer: PreTrainedTokenizerFast, chunks: Sequence[Sequence[int]]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(chunk) for chunk in chunks]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def _assert_clean_deltas(deltas: Sequence[str]) -> None:
    for delta in deltas:
        assert "\ufffd" not in delta, f"partial character leaked: {delta!r}"
        assert delta.encode("utf-8").decode("utf-8") == delta


# -------------------------------------------------------------- fixture sanity


def test_bytelevel_fixture_splits_characters_across_tokens() -> None:
    ids = _encode(BYTELEVEL, PERSIAN + EMOJI)
    assert len(BYTELEVEL) <= 320
    assert len(ids) > len(PERSIAN + EMOJI)
    prefixes = [_decode(BYTELEVEL, ids[:k]) for k in range(len(ids) + 1)]
    assert any(p.endswith("\ufffd") for p in prefixes), "no multi-token character: test is vacuous"


def test_llama_fixture_uses_byte_fallback_tokens() -> None:
    tokens = LLAMA.convert_ids_to_tokens(_encode(LLAMA, PERSIAN))
    assert any(t.startswith("<0x") for t in tokens)
    assert _decode(LLAMA, _encode(LLAMA, PERSIAN)) == PERSIAN


@pytest.mark.parametrize(
    ("name", "expected"),
    [("bytelevel", True), ("llama", True), ("metaspace", True), ("wordpiece", False)],
)
def test_window_mode_selection(name: str, expected: bool) -> None:
    assert IncrementalDetokenizer(ALL_TOKENIZERS[name]).uses_window is expected


def test_the_decoder_pipeline_is_read_once_per_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading it serializes the whole tokenizer (~0.3 s for Qwen2.5's): a request must not pay that again."""
    tokenizer = _bytelevel_tokenizer()
    backend_type = type(tokenizer.backend_tokenizer)
    calls = []
    real = backend_type.to_str
    monkeypatch.setattr(backend_type, "to_str", lambda self, *a, **kw: (calls.append(1), real(self, *a, **kw))[1])
    first = IncrementalDetokenizer(tokenizer).uses_window
    assert [IncrementalDetokenizer(tokenizer).uses_window for _ in range(3)] == [first] * 3
    assert len(calls) == 1


# ------------------------------------------------------------- detokenization


@pytest.mark.parametrize("name", sorted(UTF8_TOKENIZERS))
@pytest.mark.parametrize("text", SAMPLES)
def test_token_by_token_round_trip(name: str, text: str) -> None:
    tokenizer = UTF8_TOKENIZERS[name]
    ids = _encode(tokenizer, text)
    deltas, tail = _stream(tokenizer, [[t] for t in ids])
    _assert_clean_deltas(deltas)
    assert tail == "" or _is_byte_token(tokenizer, ids[-1])
    assert "".join(deltas) + tail == _decode(tokenizer, ids) == text


@pytest.mark.parametrize("name", sorted(UTF8_TOKENIZERS))
@given(
    text=st.sampled_from(SAMPLES) | st.text(max_size=30),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8),
)
@HYPO
def test_random_chunking_round_trip(name: str, text: str, sizes: list[int]) -> None:
    tokenizer = UTF8_TOKENIZERS[name]
    ids = _encode(tokenizer, text)
    full = _decode(tokenizer, ids)
    deltas, tail = _stream(tokenizer, _chunks(ids, sizes))
    if "\ufffd" not in full:
        _assert_clean_deltas(deltas)
        assert tail == "" or _is_byte_token(tokenizer, ids[-1])
    assert "".join(deltas) + tail == full


@pytest.mark.parametrize("name", sorted(ALL_TOKENIZERS))
@given(data=st.data())
@HYPO
def test_random_ids_concatenation_is_exact(name: str, data: st.DataObject) -> None:
    tokenizer = ALL_TOKENIZERS[name]
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40), label="ids")
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=6), label="sizes")
    deltas, tail = _stream(tokenizer, _chunks(ids, sizes))
    assert "".join(deltas) + tail == _decode(tokenizer, ids)
    assert all(isinstance(delta, str) for delta in deltas)


def test_partial_emoji_is_held_until_complete() -> None:
    ids = _encode(BYTELEVEL, "a🚀")
    assert len(ids) >= 3
    detok = IncrementalDetokenizer(BYTELEVEL)
    assert detok.push(ids[:1]) == "a"
    for token in ids[1:-1]:
        assert detok.push([token]) == ""
    assert detok.push(ids[-1:]) == "🚀"
    assert detok.text == "a🚀"


def test_flush_releases_invalid_trailing_bytes() -> None:
    ids = _encode(BYTELEVEL, "ok 🚀")
    truncated = ids[:-1]  # emoji missing its last byte token
    detok = IncrementalDetokenizer(BYTELEVEL)
    streamed = detok.push(truncated)
    assert "\ufffd" not in streamed
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert streamed + tail == _decode(BYTELEVEL, truncated)


def test_special_tokens_are_skipped_mid_stream() -> None:
    eos = BYTELEVEL.eos_token_id
    ids = [*_encode(BYTELEVEL, "hello "), eos, *_encode(BYTELEVEL, "world")]
    deltas, tail = _stream(BYTELEVEL, [[t] for t in ids])
    assert "".join(deltas) + tail == "hello world"


def test_sentencepiece_leading_space_matches_full_decode() -> None:
    eos = LLAMA.eos_token_id
    ids = [*_encode(LLAMA, "hi there"), eos, *_encode(LLAMA, "world")]
    prompt = _encode(LLAMA, "say")
    detok = IncrementalDetokenizer(LLAMA, prompt_ids=prompt)
    streamed = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert streamed == _decode(LLAMA, ids) == "hi there world"


def test_window_decodes_only_recent_tokens() -> None:
    ids = _encode(BYTELEVEL, (MIXED + " ") * 20)
    seen: list[int] = []
    spy = PreTrainedTokenizerFast(tokenizer_object=BYTELEVEL.backend_tokenizer)
    real_decode = spy._decode

    def counting_decode(token_ids: list[int], *args: object, **kwargs: object) -> str:
        seen.append(len(token_ids))
        return real_decode(token_ids, *args, **kwargs)

    spy._decode = counting_decode  # type: ignore[method-assign]
    detok = IncrementalDetokenizer(spy)
    assert detok.uses_window
    streamed = "".join(detok.push([t]) for t in ids)
    assert len(ids) > 300 and max(seen) <= 8
    assert streamed + detok.flush() == _decode(BYTELEVEL, ids)


def test_fallback_mode_handles_cleanup_rewrites() -> None:
    ids = _encode(WORDPIECE, "i do n't go . hello world ' s")
    full = _decode(WORDPIECE, ids)
    assert "n't" in full and " ." not in full  # cleanup really rewrites the text
    deltas, tail = _stream(WORDPIECE, [[t] for t in ids])
    assert "".join(deltas) + tail == full


# ----------------------------------------------------------------- TextStream


def _first_stop_token(tokenizer: PreTrainedTokenizerFast, ids: Sequence[int], stop: str) -> int:
    return next(k for k in range(1, len(ids) + 1) if stop in _decode(tokenizer, ids[:k]))


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_text_stream_stop_split_across_tokens(chunk: int) -> None:
    text = "hello world, how are you today? more text"
    ids = _encode(BYTELEVEL, text)
    stream = TextStream(BYTELEVEL, ["how are you"])
    outs = [stream.push(c) for c in _chunks(ids, [chunk])]
    flags = [stopped for _, stopped in outs]
    first = flags.index(True)
    assert flags == [False] * first + [True] * (len(flags) - first)
    assert stream.text == "".join(d for d, _ in outs) == "hello world, "
    assert stream.num_tokens_consumed == _first_stop_token(BYTELEVEL, ids, "how are you")
    assert stream.finish() == ""
    assert stream.push(ids[:1]) == ("", True)


def test_text_stream_persian_stop_not_leaked() -> None:
    ids = _encode(BYTELEVEL, PERSIAN + " 🚀")
    stream = TextStream(BYTELEVEL, ["هوا", "🚀"])
    deltas: list[str] = []
    for token in ids:
        delta, stopped = stream.push([token])
        deltas.append(delta)
        if stopped:
            break
    assert stopped
    _assert_clean_deltas(deltas)
    assert stream.text == "سلام، امروز "
    assert "هوا" not in stream.text and not stream.text.endswith("\u0647")
    assert stream.num_tokens_consumed == _first_stop_token(BYTELEVEL, ids, "هوا")
    assert stream.num_tokens_consumed < len(ids)


def test_text_stream_single_token_stop() -> None:
    eos_like = _encode(BYTELEVEL, "!")
    assert len(eos_like) == 1
    ids = _encode(BYTELEVEL, "hi") + eos_like + _encode(BYTELEVEL, " after")
    stream = TextStream(BYTELEVEL, ["!"])
    assert stream.push(ids) == ("hi", True)
    assert stream.num_tokens_consumed == len(_encode(BYTELEVEL, "hi")) + 1


def test_text_stream_without_stop_releases_held_text_on_finish() -> None:
    text = "how are you today?"
    ids = _encode(BYTELEVEL, text)
    stream = TextStream(BYTELEVEL, ["?!"])
    streamed = "".join(stream.push([t])[0] for t in ids)
    assert streamed == "how are you today"  # "?" could start "?!": held back
    assert stream.finish() == "?"
    assert stream.text == text
    assert stream.num_tokens_consumed == len(ids)
    assert not stream.stopped


def test_text_stream_finish_flushes_partial_character() -> None:
    ids = _encode(BYTELEVEL, "ok 🚀")[:-1]
    stream = TextStream(BYTELEVEL, [])
    streamed, stopped = stream.push(ids)
    assert not stopped and "\ufffd" not in streamed
    assert streamed + stream.finish() == _decode(BYTELEVEL, ids)


@given(data=st.data())
@HYPO
def test_text_stream_never_leaks_stop(data: st.DataObject) -> None:
    text = data.draw(st.sampled_from(SAMPLES), label="text")
    start = data.draw(st.integers(0, len(text) - 1), label="start")
    stop = text[start : start + data.draw(st.integers(1, 4), label="length")]
    ids = _encode(BYTELEVEL, text)
    stream = TextStream(BYTELEVEL, [stop])
    for chunk in _chunks(ids, data.draw(st.lists(st.integers(1, 4), min_size=1), label="sizes")):
        _, stopped = stream.push(chunk)
        assert stop not in stream.text
        if stopped:
            break
    assert stopped
    assert stream.text == text[: text.find(stop)]


def test_byte_fallback_group_held_until_non_byte_token() -> None:
    # A valid byte-fallback group can still turn into U+FFFDs if the next byte tokens
    # are invalid, so it only becomes final when a non-byte token closes it.
    ids = _encode(LLAMA, "a🚀 b")
    tokens = LLAMA.convert_ids_to_tokens(ids)
    first_after = next(i for i, t in enumerate(tokens) if i > 1 and not t.startswith("<0x"))
    detok = IncrementalDetokenizer(LLAMA)
    assert "".join(detok.push([t]) for t in ids[:first_after]) == "a"
    assert detok.push(ids[first_after : first_after + 1]) == "🚀 "
    garbage = [*_encode(LLAMA, "c€")[:-1], LLAMA.convert_tokens_to_ids("<0x41>")]
    detok = IncrementalDetokenizer(LLAMA)
    streamed = detok.push(garbage)
    assert streamed + detok.flush() == _decode(LLAMA, garbage) == "c\ufffd\ufffd\ufffd"
