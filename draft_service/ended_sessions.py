"""EndSessions remembered for a while, so a late Propose cannot re-create a session its owner already ended.

The draft service's sessions are created by the Propose that carries the whole context. A Propose sent before the
caller's EndSession may arrive after it (a prefetch in flight, the prefill of a request cancelled at once): it
would create a session nobody ends, held until its lease. The draft servicer remembers each EndSession's
(session id, owner token) for `keep_s` (the service's lease: after it a stray session is reaped anyway), also
when the session did not exist yet, and refuses a Propose that would create a remembered session with that token.

Plain bookkeeping with an injected clock; at most `max_entries` remembered (the oldest forgotten first).
"""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from collections.abc import Callable


class EndedSessions:
    def __init__(self, keep_s: float, max_entries: int = 65_536, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s = keep_s
        self.max_entries = max_entries
        self.clock = clock
        self._ended: OrderedDict[str, tuple[str, float]] = OrderedDict()   # session id -> (token, ended at)

    def __len__(self) -> int:
        return len(self._ended)

    def remember(self, session_id: str, token: str) -> None:
        self._forget_old()
        self._ended.pop(session_id, None)
        self._ended[session_id] = (token, self.clock())
        while len(self._ended) > self.max_entries:
            self._ended.popitem(last=False)

    def ended(self, session_id: str, token: str) -> bool:
        """Whether the owner of `token` ended this session within keep_s."""
        self._forget_old()
        entry = self._ended.get(session_id)
        return entry is not None and hmac.compare_digest(entry[0].encode(), token.encode())

    def _forget_old(self) -> None:
        cutoff = self.clock() - self.keep_s
        while self._ended:
            _, (_, at) = next(iter(self._ended.items()))
            if at > cutoff:
                break
            self._ended.popitem(last=False)
