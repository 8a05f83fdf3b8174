"""Cleanup that completes: a session's EndSession (verifier or draft service) is retried with backoff until it
succeeds or the service says the session is gone, for at most `give_up_s`; past that the service's session lease
has ended it anyway. Runs inside the request's cleanup task (gateway/servicer.py), never in the client's stream.

Answers that end the retries: OK; PERMISSION_DENIED and NOT_FOUND (the session is not open: its lease or an earlier
EndSession ended it; the draft service also remembers the EndSession, so a late Propose cannot re-create it);
INVALID_ARGUMENT and UNIMPLEMENTED (retrying cannot help). Anything else (UNAVAILABLE, DEADLINE_EXCEEDED of a hung
or restarting service, RESOURCE_EXHAUSTED, ...) is retried after 0.2 s, 0.4 s, ... doubling up to 5 s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

log = logging.getLogger(__name__)

END_SESSION_RETRY_S = 600.0           # default give-up: longer than any lease (the services' default is 60 s)
FINAL_CODES = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND,
                         grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED})


def backoff_s(attempt: int, first_s: float = 0.2, max_s: float = 5.0) -> float:
    """Wait before retry number `attempt` (1-based): first_s doubling, capped at max_s."""
    return min(max_s, first_s * 2.0 ** (attempt - 1))


async def end_until_done(call: Callable[[], Awaitable[object]], side: str, give_up_s: float = END_SESSION_RETRY_S,
                         sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                         clock: Callable[[], float] = time.monotonic) -> bool:
    """Calls `call` (one EndSession attempt with its own timeout) until it is done. True: ended or moot (the service
    holds no such session); False: gave up after give_up_s (the lease ends it)."""
    started = clock()
    attempt = 0
    while True:
        try:
            await call()
            return True
        except grpc.aio.AioRpcError as exc:
            if exc.code() in FINAL_CODES:
                return True
            attempt += 1
            wait = backoff_s(attempt)
            if clock() - started + wait > give_up_s:
                log.warning("%s: EndSession still failing after %d attempts (%s); its lease will end the session",
                            side, attempt, exc.code().name)
                return False
            if attempt == 1:
                log.info("%s: EndSession failed (%s); retrying with backoff", side, exc.code().name)
        await sleep(wait)
