"""Incremental, UTF-8-safe detokenization and stop-string handling for token streams.

The gateway receives generated token ids a few at a time (speculative decoding commits
several tokens per step) and must stream text deltas to the client such that:

* no delta ends in a partial UTF-8 character (byte-level BPE / byte-fallback tokenizers
  split one character over several tokens; a premature decode yields ``U+FFFD``);
* the concatenation of all deltas equals ``tokenizer.decode(generated_ids,
  skip_special_tokens=True)`` exactly;
* stop strings are never sent to the client, even when they arrive split over tokens.

``IncrementalDetokenizer`` uses the vLLM/TGI sliding window (``prefix_offset`` /
``read_offset``) for tokenizers whose decoder is known to make it exact, and otherwise
falls back to decoding the whole generated sequence each step and diffing against what
was already emitted.
"""

from __future__ import annotations

import json
import logging
import re
import weakref
from collections.abc import Sequence
from typing import Any, cast

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["IncrementalDetokenizer", "StopMatcher", "TextStream"]

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"

# Decoder components whose output for a token window depends only on the window's own
# tokens in a way the prefix/read diff cancels out (per-token mapping, byte fusing,
# stripping the window's first character).
_WINDOW_SAFE_DECODERS = frozenset({"ByteLevel", "Metaspace", "ByteFallback", "Fuse"})

# In full-decode mode, characters held back from the end of the decoded text because a
# text post-processing step (e.g. ``clean_up_tokenization``, which rewrites " ." or
# " n't") may still change them once more tokens arrive. Its longest pattern is 4 chars.
_FALLBACK_HOLDBACK_CHARS = 4

_BYTE_TOKEN_RE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


# --------------------------------------------------------------------------- helpers


_decoder_specs: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[str, Any] | None] = \
    weakref.WeakKeyDictionary()


def _decoder_spec(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any] | None:
    """The backend's decoder pipeline, read once per tokenizer: it means serializing the whole tokenizer (vocabulary
    and merges) to JSON, ~0.3 s for Qwen2.5's, which every request paid before its first token."""
    try:
        return _decoder_specs[tokenizer]
    except KeyError:
        spec = _decoder_specs[tokenizer] = _read_decoder_spec(tokenizer)
        return spec
    except TypeError:                                   # not weakly referenceable: no cache
        return _read_decoder_spec(tokenizer)


def _read_decoder_spec(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str()).get("decoder")
    except (AttributeError, TypeError, ValueError):
        return None
    return spec if isinstance(spec, dict) else None


def _decoder_is_window_safe(spec: dict[str, Any]) -> bool:
    kind = spec.get("type")
    if kind == "Sequence":
        parts = spec.get("decoders") or []
        return bool(parts) and all(_decoder_is_window_safe(p) for p in parts)
    if kind in _WINDOW_SAFE_DECODERS:
        return True
    if kind == "Replace":  # single-char replacement cannot match across tokens
        pattern = spec.get("pattern") or {}
        return len(pattern.get("String") or "") == 1
    if kind == "Strip":  # stripping the end would make text non-prefix-stable
        return int(spec.get("stop", 0)) == 0 and int(spec.get("start", 0)) <= 1
    return False


def _decoder_uses_byte_fallback(spec: dict[str, Any]) -> bool:
    if spec.get("type") == "Sequence":
        return any(_decoder_uses_byte_fallback(p) for p in spec.get("decoders") or [])
    return spec.get("type") == "ByteFallback"


def _cleanup_applies(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``decode`` post-processes text with ``clean_up_tokenization``."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return not (type(model).__name__ == "BPE" and not forced)


def _uses_stock_decode(tokenizer: PreTrainedTokenizerBase) -> bool:
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
    )


def _trailing_replacement_run(text: str) -> int:
    return len(text) - len(text.rstrip(REPLACEMENT_CHAR))


# ------------------------------------------------------------------- detokenizer


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into final, UTF-8-complete text deltas.

    Invariant: ``"".join(push(...) for each chunk) + flush()`` equals
    ``tokenizer.decode(all_generated_ids, skip_special_tokens=True)``.

    ``prompt_ids`` are accepted for API compatibility but deliberately not used as left
    context: for sentencepiece-style decoders, ``decode(generated_ids)`` strips the
    leading space of the first generated token, and prompt context would re-insert it,
    breaking the exactness invariant (the invariant wins).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._prompt_len = len(prompt_ids)
        self._ids: list[int] = []
        self._parts: list[str] = []
        self._emitted_chars = 0
        spec = _decoder_spec(tokenizer)
        self._window = (
            spec is not None
            and _decoder_is_window_safe(spec)
            and _uses_stock_decode(tokenizer)
            and not _cleanup_applies(tokenizer)
        )
        self._byte_fallback = spec is not None and _decoder_uses_byte_fallback(spec)
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        # Sliding window state: ids[prefix:read] is text already emitted (decoding to
        # prefix_text), ids[read:] is not yet emitted.
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""
        self._mismatch_logged = False

    # ---------------------------------------------------------------- public API

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    @property
    def uses_window(self) -> bool:
        """True while the O(new tokens) sliding-window path is in use."""
        return self._window

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated tokens; return the text that became final."""
        if not token_ids:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        delta = self._push_window() if self._window else self._push_full()
        return self._emit(delta)

    def flush(self) -> str:
        """Emit everything still held back (even an invalid trailing character)."""
        full = self._decode(self._ids)
        emitted = self.text
        if not full.startswith(emitted):
            self._log_mismatch(full, emitted)
        # Anything pushed afterwards is diffed against a full decode.
        self._window = False
        return self._emit(full[len(emitted) :])

    # ------------------------------------------------------------- internals

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return cast(str, self._tokenizer.decode(list(ids), skip_special_tokens=True))     # one sequence: one str

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
            self._emitted_chars += len(delta)
        return delta

    def _must_hold(self, text: str) -> bool:
        """True if the window's text may still change when more tokens arrive."""
        if text.endswith(REPLACEMENT_CHAR):
            return True
        return self._byte_fallback and self._in_byte_group()

    def _in_byte_group(self) -> bool:
        """ByteFallback decodes a run of byte tokens as a whole (all U+FFFD if invalid),
        so the run is final only once a surviving (non-skipped) non-byte token follows."""
        for token_id in reversed(self._ids):
            if token_id in self._special_ids:  # skipped: does not close the run
                continue
            token = self._tokenizer.convert_ids_to_tokens(token_id)
            return isinstance(token, str) and _BYTE_TOKEN_RE.match(token) is not None
        return False

    def _push_window(self) -> str:
        new_text = self._decode(self._ids[self._prefix :])
        if self._must_hold(new_text):
            return ""
        if not new_text.startswith(self._prefix_text):
            # The window assumption failed for this tokenizer: switch to full decoding.
            self._window = False
            return self._push_full()
        delta = new_text[len(self._prefix_text) :]
        self._advance_window(new_text)
        return delta

    def _advance_window(self, new_text: str) -> None:
        end = len(self._ids)
        candidate = self._decode(self._ids[self._read : end])
        if candidate:
            self._prefix, self._prefix_text = self._read, candidate
        else:
            # An empty prefix window (skipped special tokens, a stripped lone space)
            # would let leading-space stripping differ between prefix and new text.
            self._prefix_text = new_text
        self._read = end

    def _push_full(self) -> str:
        full = self._decode(self._ids)
        emitted = self.text
        if not full.startswith(emitted):
            self._log_mismatch(full, emitted)
            return ""
        stable_end = len(full) - _trailing_replacement_run(full) - _FALLBACK_HOLDBACK_CHARS
        return full[len(emitted) : max(stable_end, len(emitted))]

    def _log_mismatch(self, full: str, emitted: str) -> None:
        if self._mismatch_logged:
            return
        self._mismatch_logged = True
        logger.warning(
            "detokenizer: decode is not prefix-stable for %s (emitted %d chars, full decode %d chars);"
            " streamed text may differ from the final decode",
            type(self._tokenizer).__name__,
            len(emitted),
            len(full),
        )


# ------------------------------------------------------------------ stop strings


class StopMatcher:
    """Withholds text that is, or may become, a stop string.

    Text is released only once it can no longer be the start of a stop string; when a
    stop string appears, everything before its first occurrence is released and the
    matcher reports ``stopped``.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._pending = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return ``(text safe to emit now, stopped)``."""
        if self._stopped:
            return "", True
        self._pending += text
        cut = self._first_stop_index(self._pending)
        if cut is not None:
            out, self._pending, self._stopped = self._pending[:cut], "", True
            return out, True
        keep = self._held_suffix_len(self._pending)
        split = len(self._pending) - keep
        out, self._pending = self._pending[:split], self._pending[split:]
        return out, False

    def flush(self) -> str:
        """Release held-back text at the end of generation (no stop string occurred)."""
        out, self._pending = ("" if self._stopped else self._pending), ""
        return out

    def _first_stop_index(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a prefix of a stop string."""
        longest = max((len(s) for s in self._stops), default=0)
        for k in range(min(len(text), longest - 1), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self._stops):
                return k
        return 0


# ------------------------------------------------------------------------- glue


class TextStream:
    """Tokens in, ``(delta_text, stopped)`` out: detokenizer followed by stop matcher."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop_strings: Sequence[str],
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._matcher = StopMatcher(stop_strings)
        self._parts: list[str] = []
        self._consumed = 0
        self._finished = False

    @property
    def text(self) -> str:
        """Everything emitted to the client so far."""
        return "".join(self._parts)

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    @property
    def num_tokens_consumed(self) -> int:
        """Tokens up to and including the one that completed the stop string (if any)."""
        return self._consumed

    def push(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Feed tokens one at a time so a stop pins down the token that completed it."""
        out: list[str] = []
        for token_id in token_ids:
            if self._matcher.stopped or self._finished:
                break
            self._consumed += 1
            text, _ = self._matcher.feed(self._detok.push([token_id]))
            out.append(text)
        return self._emit("".join(out)), self._matcher.stopped

    def finish(self) -> str:
        """End of generation (eos / max tokens): flush the detokenizer, then the matcher."""
        if self._finished or self._matcher.stopped:
            self._finished = True
            return ""
        self._finished = True
        text, stopped = self._matcher.feed(self._detok.flush())
        if not stopped:
            text += self._matcher.flush()
        return self._emit(text)

    def _emit(self, text: str) -> str:
        if text:
            self._parts.append(text)
        return text
