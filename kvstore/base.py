"""The draft cache interface and the helpers its implementations share."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

MAX_CONTINUATION_TOKENS = 16     # longest continuation stored per suffix
MAX_CONTINUATIONS = 4            # continuations kept per suffix (the most frequent win)


@dataclass
class CacheCounters:
    """Plain ints for the gateway's metrics."""

    lookups: int = 0
    hits: int = 0
    errors: int = 0              # failed reads or write batches (Redis down, timeout, ...)
    records: int = 0
    dropped: int = 0             # records not written: queue full or store unavailable


class DraftCache(Protocol):
    """Maps (scope, last n context tokens) to the verified continuations seen after them, for a few n."""

    counters: CacheCounters

    async def lookup(self, scope: str, context_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The most frequent continuation after the longest cached suffix of context_ids; [] on a miss or error."""
        ...

    def record(self, scope: str, context_ids: Sequence[int], verified_ids: Sequence[int]) -> None:
        """Learn that verified_ids followed context_ids. Never blocks: writes happen behind the caller."""
        ...

    async def close(self) -> None:
        """Flush pending writes (best effort) and release connections."""
        ...


class LogLimiter:
    """Logs a warning at most once per interval, so an outage cannot flood the log."""

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last = -float("inf")
        self.suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self.suppressed += 1
            return
        self._last = now
        if self.suppressed:
            msg += f" ({self.suppressed} similar messages suppressed)"
            self.suppressed = 0
        self.logger.warning(msg, *args, stacklevel=2)
