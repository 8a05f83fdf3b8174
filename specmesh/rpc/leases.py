"""Who owns each session, and when an idle one is given up: plain bookkeeping with an injected clock.

Used by the verifier's and the draft service's servicers (the engines know nothing of owners or leases).

Contract:
- `open(session_id)` opens a lease and returns its unguessable owner token (or binds the caller's own `token`).
  Opening a session id that is open: ALREADY_EXISTS.
- Every later call presents the token. A session that is not open and a token that does not match get the same
  PERMISSION_DENIED, so a caller without the token cannot tell whether the session exists.
- Idle time is what expires a lease: `call()` holds it while a call runs (a slow prefill or a long queue never
  expires a session), and the idle period starts when the last call ends (or at `open`). A lease is expired when
  it has no call in flight and `now - last_used >= lease_s`.
- `expired(now)` only lists; the owner of the table ends those sessions and `close()`s them (`reap_expired`).

Invariants (`check_invariants`): every lease has `in_flight >= 0` and a non-empty token.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from specmesh.engine.errors import EngineError

log = logging.getLogger(__name__)

MAX_SESSION_ID_BYTES = 256
MAX_OWNER_TOKEN_BYTES = 256


def check_session_id(session_id: str) -> str:
    """INVALID_ARGUMENT unless 1..MAX_SESSION_ID_BYTES bytes."""
    if not session_id:
        raise EngineError("INVALID_ARGUMENT", "session_id is required")
    size = len(session_id.encode())
    if size > MAX_SESSION_ID_BYTES:
        raise EngineError("INVALID_ARGUMENT", f"session_id is {size} bytes; the limit is {MAX_SESSION_ID_BYTES}")
    return session_id


def new_session_id(name: str) -> str:
    """A unique session id that starts with `name` (e.g. a request id, cut to fit) and stays within the bound."""
    suffix = secrets.token_hex(4)
    head = name.encode()[:MAX_SESSION_ID_BYTES - len(suffix) - 1].decode(errors="ignore")
    return f"{head}-{suffix}"


def check_owner_token(token: str) -> str:
    """INVALID_ARGUMENT unless 1..MAX_OWNER_TOKEN_BYTES bytes (for a token the caller chooses)."""
    if not token:
        raise EngineError("INVALID_ARGUMENT", "owner_token is required")
    if len(token.encode()) > MAX_OWNER_TOKEN_BYTES:
        raise EngineError("INVALID_ARGUMENT", f"owner_token is longer than {MAX_OWNER_TOKEN_BYTES} bytes")
    return token


@dataclass
class _Lease:
    token: str = field(repr=False)
    last_used: float          # clock() when the last call ended (or the lease opened)
    in_flight: int = 0        # calls of this session running now


class SessionLeases:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self.clock = clock
        self._leases: dict[str, _Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._leases

    def open(self, session_id: str, token: str | None = None) -> str:
        """Opens a lease owned by `token` (default: a new random one) and returns the token."""
        if session_id in self._leases:
            raise EngineError("ALREADY_EXISTS", f"session {session_id} already exists")
        token = token or secrets.token_urlsafe(16)
        self._leases[session_id] = _Lease(token, self.clock())
        return token

    def bind(self, session_id: str, token: str) -> bool:
        """For a caller-chosen token: opens the lease if the session is not open (True), else checks (False)."""
        if session_id in self._leases:
            self.check(session_id, token)
            return False
        self.open(session_id, token)
        return True

    def _owned(self, session_id: str, token: str) -> _Lease:
        lease = self._leases.get(session_id)
        if lease is None or not token or not hmac.compare_digest(lease.token.encode(), token.encode()):
            raise EngineError("PERMISSION_DENIED",
                              f"session {session_id} is not open or owner_token does not match")
        return lease

    def check(self, session_id: str, token: str) -> None:
        """PERMISSION_DENIED unless the session is open and `token` is its owner's."""
        self._owned(session_id, token)

    @contextmanager
    def call(self, session_id: str, token: str) -> Iterator[None]:
        """Checks the token, then holds the lease until the block exits (however it exits)."""
        lease = self._owned(session_id, token)
        lease.in_flight += 1
        try:
            yield
        finally:
            lease.in_flight -= 1            # the lease object, not the id: it may have been closed and reopened
            lease.last_used = self.clock()

    def expired(self, now: float | None = None) -> list[str]:
        """Open sessions with no call in flight and idle for at least lease_s."""
        now = self.clock() if now is None else now
        return [sid for sid, lease in self._leases.items()
                if lease.in_flight == 0 and now - lease.last_used >= self.lease_s]

    def close(self, session_id: str) -> bool:
        """Forgets the session (its token no longer opens anything); False when it was not open."""
        return self._leases.pop(session_id, None) is not None

    def check_invariants(self) -> None:
        for sid, lease in self._leases.items():
            assert lease.in_flight >= 0, (sid, lease)
            assert lease.token, sid


def reap_interval_s(lease_s: float) -> float:
    """How often to look for expired leases: a session outlives its lease by at most this."""
    return min(1.0, lease_s / 4)


def reap_expired(leases: SessionLeases, end_session: Callable[[str], None],
                 on_expired: Callable[[], None]) -> list[str]:
    """Ends every expired session once (engine first, then the lease); returns their ids."""
    ended = leases.expired()
    for session_id in ended:
        end_session(session_id)
        leases.close(session_id)
        on_expired()
    if ended:
        log.info("ended %d idle session(s) whose lease (%.1f s) ran out: %s", len(ended), leases.lease_s,
                 ", ".join(ended[:5]))
    return ended


async def reap_forever(leases: SessionLeases, end_session: Callable[[str], None],
                       on_expired: Callable[[], None]) -> None:
    """The asyncio task of a model service: reaps expired sessions until cancelled."""
    while True:
        await asyncio.sleep(reap_interval_s(leases.lease_s))
        reap_expired(leases, end_session, on_expired)
