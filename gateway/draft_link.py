"""The client half of the draft link (the protocol is written down in protos/specmesh/v1/draft.proto).

A small state machine on plain ints and token lists: no gRPC, no asyncio, no clock. `ModelDrafter` sends what
`send()` says and reports every failed call with `on_error()`, which answers what to do next.

States
    UNBOUND   the service holds nothing of ours that we may rely on: the next call sends the whole context (which
              (re)binds the session to our owner token).
    SYNCED    the service holds `num_synced` verified tokens of our context, then `spec_ids` (a draft block a
              prefetch told it to assume accepted). The next call sends everything after the longest prefix of that
              which is still right.
    BACKOFF   the service failed: no calls for `backoff_rounds` more rounds, then UNBOUND.

Transitions
    send(context, num_verified)             UNBOUND / SYNCED -> SYNCED(num_verified, context[num_verified:])
        Optimistic: the state is updated when the call is SENT. The service handles one session's calls in order,
        so a later call (e.g. the Propose after a prefetch) may be computed against it before its answer arrives.
    on_error(earlier call, ABORTED | CANCELLED)  SKIP, no change: the service applied its sync before ending it.
    on_error(earlier call, anything else)   -> UNBOUND; SKIP: its sync may not have reached the service, so the next
                                               call sends the whole context (the latest call, already sent, may get
                                               drafts for a wrong context: they cost acceptance, never exactness).
    on_error(latest, ABORTED | CANCELLED)   -> UNBOUND; SKIP (overtaken by an earlier-sent call of ours that
                                               arrived later / session ended: what the service holds is unknown).
    on_error(latest, NOT_FOUND)             -> UNBOUND; RESEND_WHOLE now (the service lost the session: restart,
                                               lease expiry). A whole-context call that gets NOT_FOUND: as below.
    on_error(latest, anything else)         -> BACKOFF(BACKOFF_ROUNDS); FAILURE (rounds go target-only). This
                                               includes PERMISSION_DENIED (another owner holds the session id).
    round_allowed()                         BACKOFF(n) -> BACKOFF(n - 1), and -> UNBOUND after the last round.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specmesh.spec.token_ids import common_prefix_len

BACKOFF_ROUNDS = 8   # rounds without model drafts after a draft-service failure


class LinkState(enum.Enum):
    UNBOUND = "unbound"
    SYNCED = "synced"
    BACKOFF = "backoff"


class OnError(enum.Enum):
    RESEND_WHOLE = "resend_whole"    # call again now: the whole context (rebinds the owner token)
    SKIP = "skip"                    # this call's answer is gone; no draft this time, the link is fine
    FAILURE = "failure"              # the service failed: target-only for a while


@dataclass(frozen=True)
class LinkCall:
    """One Propose's sync part: `new_token_ids` go at position `context_len - len(new_token_ids)`."""
    call_id: int
    context_len: int
    new_token_ids: list[int]
    num_assumed_tokens: int          # the context's last tokens that are a guess (prefetch), not verified

    @property
    def whole_context(self) -> bool:
        return len(self.new_token_ids) == self.context_len


@dataclass
class DraftLink:
    num_synced: int = 0
    spec_ids: list[int] = field(default_factory=list)
    bound: bool = False              # a call was sent since the last UNBOUND
    backoff_rounds: int = 0
    num_calls: int = 0               # id of the latest call sent
    num_failures: int = 0
    num_resends: int = 0             # whole-context resends after NOT_FOUND (service restart, lease expiry)

    @property
    def state(self) -> LinkState:
        if self.backoff_rounds > 0:
            return LinkState.BACKOFF
        return LinkState.SYNCED if self.bound else LinkState.UNBOUND

    def round_allowed(self) -> bool:
        """Called once per round that wants model drafts: False while backing off (uses up one round)."""
        if self.backoff_rounds > 0:
            self.backoff_rounds -= 1
            return False
        return True

    def send(self, context_ids: list[int], num_verified: int | None = None) -> LinkCall:
        """The next Propose's sync part for `context_ids`, whose first `num_verified` (default all) are verified."""
        verified = len(context_ids) if num_verified is None else num_verified
        base = len(context_ids) - self.num_unsynced(context_ids)
        self.num_synced, self.spec_ids, self.bound = verified, list(context_ids[verified:]), True
        self.num_calls += 1
        return LinkCall(self.num_calls, len(context_ids), list(context_ids[base:]), len(context_ids) - verified)

    def num_unsynced(self, context_ids: list[int]) -> int:
        """How many tokens of `context_ids` the next call would send: those after the longest prefix the service
        still holds (all of them while unbound)."""
        if not self.bound:
            return len(context_ids)
        base = self.num_synced + common_prefix_len(self.spec_ids, context_ids[self.num_synced:])
        return len(context_ids) - min(base, len(context_ids), self.num_synced + len(self.spec_ids))

    def on_error(self, call: LinkCall, code: str) -> OnError:
        """`code`: the gRPC status name of the failed call."""
        if call.call_id != self.num_calls:
            # A later call was sent, computed against this one's sync. ABORTED / CANCELLED calls were synced by the
            # service before they ended; any other failure may not have been: send the whole context next time.
            if code not in ("ABORTED", "CANCELLED"):
                self.unbind()
            return OnError.SKIP
        self.unbind()
        if code in ("ABORTED", "CANCELLED"):
            return OnError.SKIP
        if code == "NOT_FOUND" and not call.whole_context:
            self.num_resends += 1
            return OnError.RESEND_WHOLE
        self.num_failures += 1
        self.backoff_rounds = BACKOFF_ROUNDS
        return OnError.FAILURE

    def unbind(self) -> None:
        self.num_synced, self.spec_ids, self.bound = 0, [], False
