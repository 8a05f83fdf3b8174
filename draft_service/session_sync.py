"""The service half of the draft link's sync (the protocol: protos/specmesh/v1/draft.proto): pure logic on token
lists and ints, no torch. The engine applies what `place_delta` and `plan_sync` decide to its session.

A session holds `token_ids` = the caller's context (its first `num_verified` tokens verified, the rest assumed by a
prefetch) followed by a drafted tail; `context_len` marks where the tail starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.engine.loop import EngineError
from specmesh.spec.token_ids import common_prefix_len


@dataclass(frozen=True)
class SyncPlan:
    context: list[int]          # the session's new context
    num_verified: int           # of which verified (verified tokens stay verified)
    reset: bool                 # the call rewrote verified tokens: drop everything and start over
    tail_kept_from: int | None  # the context continues into the drafted tail: keep the tail from this index of it
    num_computed_cap: int       # KV beyond this many tokens is stale (or must run again)


def place_delta(known: bool, session_context_len: int, context_len: int, num_new: int) -> int:
    """Where a call's new tokens go (the index of the first one). NOT_FOUND when the session is unknown and the call
    does not carry the whole context, or when the delta does not fit what the session holds: resend everything."""
    base = context_len - num_new
    if not known and base != 0:
        raise EngineError("NOT_FOUND", "unknown draft session: send the whole context")
    if base < 0 or base > session_context_len:
        raise EngineError("NOT_FOUND", "draft session is out of sync: send the whole context")
    return base


def plan_sync(token_ids: list[int], num_verified: int, context_len: int, context: list[int],
              num_assumed: int) -> SyncPlan:
    """How a session holding `token_ids` (tail from `context_len`) becomes one holding `context`, whose last
    `num_assumed` tokens are assumed (not verified)."""
    verified = max(len(context) - min(num_assumed, len(context)), 0)
    match = common_prefix_len(token_ids, context)
    if match < num_verified:                         # rewrites verified tokens (a confused caller)
        return SyncPlan(context, verified, True, None, 0)
    if match == len(context) >= context_len:         # the context continues into what was drafted
        return SyncPlan(context, max(verified, num_verified), False, match - context_len, len(token_ids))
    # Stale tail: roll back. The last context token runs again even when its KV is current (the context dropped
    # assumed tokens and is a prefix of what ran): drafting needs the logits after it.
    return SyncPlan(context, max(verified, num_verified), False, None, min(match, len(context) - 1))
