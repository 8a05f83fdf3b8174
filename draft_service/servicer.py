"""Thin gRPC servicer of the draft service: validate, delegate to the engine, map errors to status codes."""

from __future__ import annotations

import grpc

from draft_service.engine import DraftEngine, Drafts
from protos.specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specmesh.engine.loop import EngineError
from specmesh.grpc_server import status_code
from specmesh.proto_convert import sampling_from_proto, sparse_dists_to_proto


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, engine: DraftEngine, vocab_size: int, max_draft_tokens: int, max_q_entries: int) -> None:
        self.engine = engine
        self.vocab_size = vocab_size
        self.max_draft_tokens = max_draft_tokens
        self.max_q_entries = max_q_entries

    def _validate(self, request: draft_pb2.ProposeRequest) -> None:
        if not request.session_id:
            raise EngineError("INVALID_ARGUMENT", "session_id is required")
        if request.num_draft_tokens > self.max_draft_tokens:
            raise EngineError("INVALID_ARGUMENT",
                              f"num_draft_tokens must be <= {self.max_draft_tokens}, got {request.num_draft_tokens}")
        if request.context_len < len(request.new_token_ids) or request.context_len == 0:
            raise EngineError("INVALID_ARGUMENT", "context_len must be >= len(new_token_ids) and > 0")
        if request.num_assumed_tokens > request.context_len:
            raise EngineError("INVALID_ARGUMENT", "num_assumed_tokens must be <= context_len")
        bad = [t for t in request.new_token_ids if t >= self.vocab_size]
        if bad:
            raise EngineError("INVALID_ARGUMENT", f"new_token_ids: token id {bad[0]} >= vocab size {self.vocab_size}")

    async def Propose(self, request: draft_pb2.ProposeRequest,
                      context: grpc.aio.ServicerContext) -> draft_pb2.ProposeResponse:
        try:
            self._validate(request)
            params = sampling_from_proto(request.sampling)
            max_q = min(request.max_q_entries or self.max_q_entries, self.max_q_entries)
            proposal: Drafts = await self.engine.propose(
                request.session_id, request.context_len, list(request.new_token_ids), request.num_draft_tokens,
                params, max_q, min(request.num_ahead_tokens, 2 * self.max_draft_tokens + 1),
                request.num_assumed_tokens).future
        except EngineError as exc:
            await context.abort(status_code(exc.code), str(exc))
        return draft_pb2.ProposeResponse(draft_token_ids=proposal.draft_ids,
                                         draft_dists=sparse_dists_to_proto(proposal.draft_dists))

    async def EndSession(self, request: common_pb2.EndSessionRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.EndSessionResponse:
        self.engine.end_session(request.session_id)
        return common_pb2.EndSessionResponse()
