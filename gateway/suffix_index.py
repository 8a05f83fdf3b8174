"""The per-request layer of suffix drafting: the request's own context (prompt + verified output so far).

Equivalent to walking a suffix tree of the context: the longest suffix of the context that also occurred earlier is
the matched node, and the tokens that followed its earlier occurrences, with their counts, are its subtree. This
subsumes n-gram prompt lookup (which takes only the latest occurrence of a fixed-length tail). Plain ints: a list of
tokens and, per token id, the positions where it occurs; no model, no network.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.suffix_tree import CountNode

MAX_MATCH = 32               # longest context suffix matched (longer matches say nothing more)
MAX_CANDIDATES = 256         # most recent occurrences of the last token examined per lookup
MAX_OCCURRENCES = 64         # occurrences of the matched suffix whose continuations are counted


class ContextIndex:
    def __init__(self, max_match: int = MAX_MATCH, max_candidates: int = MAX_CANDIDATES,
                 max_occurrences: int = MAX_OCCURRENCES) -> None:
        self.max_match = max_match
        self.max_candidates = max_candidates
        self.max_occurrences = max_occurrences
        self.tokens: list[int] = []
        self._positions: dict[int, list[int]] = {}

    def sync(self, context: Sequence[int]) -> None:
        """Makes the index hold `context`; appends when it extends what is held (the usual case)."""
        held = len(self.tokens)
        if len(context) < held or list(context[:held]) != self.tokens:
            self.tokens, self._positions, held = [], {}, 0
        for i in range(held, len(context)):
            t = context[i]
            self.tokens.append(t)
            self._positions.setdefault(t, []).append(i)

    def match(self) -> tuple[int, list[int]]:
        """(length of the longest suffix of the context that occurred earlier, end positions of those earlier
        occurrences, most recent first). (0, []) when even the last token is new."""
        tokens, n = self.tokens, len(self.tokens)
        if n < 2:
            return 0, []
        best, ends = 0, []
        candidates = self._positions.get(tokens[-1], [])
        for k in range(len(candidates) - 1, max(-1, len(candidates) - 1 - self.max_candidates), -1):
            i = candidates[k]
            if i >= n - 1:
                continue
            length = 1
            while length < self.max_match and i - length >= 0 and tokens[i - length] == tokens[n - 1 - length]:
                length += 1
            if length > best:
                best, ends = length, [i]
            elif length == best and len(ends) < self.max_occurrences:
                ends.append(i)
        return best, ends

    def trie(self, depth: int) -> tuple[CountNode, int]:
        """(the subtree below the longest matched suffix, `depth` tokens deep; the match length)."""
        length, ends = self.match()
        root = CountNode(len(ends))                   # every earlier occurrence ends before the last token
        if length > 0 and depth > 0:
            self._grow(root, ends, depth)
        return root, length

    def _grow(self, node: CountNode, ends: list[int], depth: int) -> None:
        """A node counts the occurrences that reach it; one ending at the context's end has no child."""
        tokens, n = self.tokens, len(self.tokens)
        groups: dict[int, list[int]] = {}
        for e in ends:
            if e + 1 < n:
                groups.setdefault(tokens[e + 1], []).append(e + 1)
        for t, group in groups.items():
            child = node.children[t] = CountNode(len(group))
            if depth > 1:
                self._grow(child, group, depth - 1)
