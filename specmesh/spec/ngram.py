"""Prompt lookup: find the context's last n tokens earlier in the same context and propose what followed.

Costs no model call and no network: repeated code, quoted text and lists often continue the way they did before.
The search runs over packed 4-byte token ids with bytes.rfind (C speed), within a bounded window.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

SEARCH_WINDOW = 8192          # tokens searched back from the end of the context

_ITEM = array("I").itemsize   # 4 on every supported platform


def _rfind_aligned(haystack: bytes, needle: bytes, end: int) -> int:
    """Start index (in tokens) of the last token-aligned occurrence of needle ending at or before byte `end`."""
    pos = haystack.rfind(needle, 0, end)
    while pos > 0 and pos % _ITEM:
        pos = haystack.rfind(needle, 0, pos + len(needle) - 1)
    return pos // _ITEM if pos >= 0 else -1


def propose_ngram(context: Sequence[int], sizes: Sequence[int], max_tokens: int) -> list[int]:
    """Up to max_tokens that followed the most recent earlier occurrence of the longest matching tail n-gram."""
    if max_tokens <= 0:
        return []
    window = list(context[-SEARCH_WINDOW:])
    packed = array("I", window).tobytes()
    for n in sorted(sizes, reverse=True):
        if n < 1 or len(window) <= n:
            continue
        needle = packed[-n * _ITEM:]
        # The match must end before the last token, so at least one token follows it.
        start = _rfind_aligned(packed, needle, (len(window) - 1) * _ITEM)
        if start >= 0:
            return window[start + n: start + n + max_tokens]
    return []
