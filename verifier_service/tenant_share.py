"""The verifier's admission keeps a share for tenants that hold nothing: one tenant cannot take the last sessions.

The last `reserve` of the verifier's session slots (VerifierConfig.tenant_reserve_sessions) go only to a tenant that
holds no session here yet; a tenant that holds one or more is refused them (RESOURCE_EXHAUSTED, with the gateway's
retry hint). Tenants come from StartSessionRequest.tenant (the gateway's API-key tenant); an untagged session ("":
a caller from before the field) is never refused by this rule but counts towards the slots in use.

Plain bookkeeping: session id -> tenant, pruned of sessions that are no longer open (any way a session ends: an
EndSession, its lease, a failed start) at each admission, so no end path needs to call back here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container

from specmesh.engine.errors import EngineError


class TenantShare:
    def __init__(self, max_sessions: int, reserve: int) -> None:
        self.max_sessions = max_sessions
        self.reserve = max(0, min(reserve, max_sessions - 1))     # someone can always get a session
        self.owners: dict[str, str] = {}

    def held(self) -> Counter[str]:
        return Counter(self.owners.values())

    def admit(self, session_id: str, tenant: str, open_sessions: Container[str]) -> None:
        """Records the session's tenant, or RESOURCE_EXHAUSTED when it would take a reserved slot it may not."""
        self.owners = {sid: t for sid, t in self.owners.items() if sid in open_sessions}
        free = self.max_sessions - len(self.owners)
        holds = sum(1 for t in self.owners.values() if t == tenant)
        if tenant and holds and free <= self.reserve:
            raise EngineError("RESOURCE_EXHAUSTED", f"verifier: the last {self.reserve} session slots are kept for "
                              f"tenants that hold none, and this tenant holds {holds}")
        self.owners[session_id] = tenant

    def release(self, session_id: str) -> None:
        self.owners.pop(session_id, None)
