"""Thin gRPC servicer of the draft service: validate, check the session's owner, delegate to the engine.

Errors are raised (EngineError) and mapped to status codes in one place, `specmesh/rpc_guard.py`.
Sessions are owned and leased (`specmesh/leases.py`): the caller chooses an owner token, the Propose that creates
the session binds it, and every later Propose / EndSession must present it (else PERMISSION_DENIED). A session
idle for the lease period is ended by the service's reaper task (draft_service/server.py). An EndSession is
remembered for the lease period (specmesh/ended_sessions.py): a Propose that arrives after it, even one that was
sent first, is CANCELLED instead of creating the session again.
"""

from __future__ import annotations

import grpc

from draft_service.engine import DraftEngine, Drafts
from protos.specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specmesh.config import InputLimits
from specmesh.ended_sessions import EndedSessions
from specmesh.engine.loop import EngineError
from specmesh.leases import SessionLeases, check_owner_token, check_session_id
from specmesh.limits import check_token_ids
from specmesh.proto_convert import sampling_from_proto, sparse_dists_to_proto

MAX_TREE_WIDTH = 8


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, engine: DraftEngine, vocab_size: int, max_draft_tokens: int, max_q_entries: int,
                 leases: SessionLeases, limits: InputLimits | None = None) -> None:
        self.engine = engine
        self.limits = limits or InputLimits()
        self.ended = EndedSessions(leases.lease_s, clock=leases.clock)   # closes the Propose / EndSession race
        self.leases = leases
        self.vocab_size = vocab_size
        self.max_draft_tokens = max_draft_tokens
        self.max_q_entries = max_q_entries

    def _validate(self, request: draft_pb2.ProposeRequest) -> None:
        check_session_id(request.session_id)
        check_owner_token(request.owner_token)
        check_token_ids(len(request.new_token_ids), self.limits, "new_token_ids", "DRAFT")
        if request.num_draft_tokens > self.max_draft_tokens:
            raise EngineError("INVALID_ARGUMENT",
                              f"num_draft_tokens must be <= {self.max_draft_tokens}, got {request.num_draft_tokens}")
        if request.context_len < len(request.new_token_ids) or request.context_len == 0:
            raise EngineError("INVALID_ARGUMENT", "context_len must be >= len(new_token_ids) and > 0")
        if request.num_assumed_tokens > request.context_len:
            raise EngineError("INVALID_ARGUMENT", "num_assumed_tokens must be <= context_len")
        if request.tree_width > MAX_TREE_WIDTH or not 0.0 <= request.tree_confidence <= 1.0:
            raise EngineError("INVALID_ARGUMENT",
                              f"tree_width must be <= {MAX_TREE_WIDTH} and tree_confidence in [0, 1]")
        bad = [t for t in request.new_token_ids if t >= self.vocab_size]
        if bad:
            raise EngineError("INVALID_ARGUMENT", f"new_token_ids: token id {bad[0]} >= vocab size {self.vocab_size}")

    async def Propose(self, request: draft_pb2.ProposeRequest,
                      context: grpc.aio.ServicerContext) -> draft_pb2.ProposeResponse:
        self._validate(request)
        params = sampling_from_proto(request.sampling)
        max_q = min(request.max_q_entries or self.max_q_entries, self.max_q_entries)
        session_id = request.session_id
        if session_id not in self.leases and self.ended.ended(session_id, request.owner_token):
            # A Propose that arrives after its session's EndSession: it must not create the session again.
            raise EngineError("CANCELLED", "the session was ended before this call arrived")
        opened = self.leases.bind(session_id, request.owner_token)
        try:
            with self.leases.call(session_id, request.owner_token):
                proposal: Drafts = await self.engine.propose(
                    session_id, request.context_len, list(request.new_token_ids), request.num_draft_tokens,
                    params, max_q, min(request.num_ahead_tokens, 2 * self.max_draft_tokens + 1),
                    request.num_assumed_tokens, request.tree_width, request.tree_confidence).future
        except BaseException:
            if opened:      # the call that created the session failed: nothing of it stays (the caller resends)
                self.leases.close(session_id)
                self.engine.end_session(session_id)
            raise
        alternatives = [draft_pb2.DraftAlternative(position=i, token_ids=a.token_ids, probs=a.probs)
                        for i, a in sorted(proposal.alternatives.items())]
        return draft_pb2.ProposeResponse(draft_token_ids=proposal.draft_ids,
                                         draft_dists=sparse_dists_to_proto(proposal.draft_dists),
                                         alternatives=alternatives)

    async def EndSession(self, request: common_pb2.EndSessionRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.EndSessionResponse:
        session_id = check_session_id(request.session_id)
        if request.owner_token:
            self.ended.remember(session_id, check_owner_token(request.owner_token))   # even if not created yet
        self.leases.check(session_id, request.owner_token)
        self.leases.close(session_id)
        self.engine.end_session(session_id)
        return common_pb2.EndSessionResponse()

    async def KeepAlive(self, request: common_pb2.KeepAliveRequest,
                        context: grpc.aio.ServicerContext) -> common_pb2.KeepAliveResponse:
        """Renews the lease of an open session (never creates one) and does nothing else."""
        with self.leases.call(check_session_id(request.session_id), request.owner_token):
            pass
        return common_pb2.KeepAliveResponse(lease_s=self.leases.lease_s)
