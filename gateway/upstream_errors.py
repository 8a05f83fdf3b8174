"""What a client is told when an internal service fails its request: the side that failed, never internal ids.

The verifier's and draft service's messages may name the session id the gateway chose for the request (an internal
id: with the owner token it would address the session); it is replaced before the message reaches the client.
"""

from __future__ import annotations

SESSION_WORDS = "this request's session"


def public_details(side: str, details: str, session_ids: tuple[str, ...]) -> str:
    """`side: details`, each of `session_ids` (and 'session <id>') replaced by words."""
    text = details or "failed"
    for session_id in sorted(filter(None, session_ids), key=len, reverse=True):   # longest first: ids may nest
        text = text.replace(f"session {session_id}", SESSION_WORDS).replace(session_id, SESSION_WORDS)
    return f"{side}: {text}"
