"""Thin gRPC servicer of the verifier: validate, check the session's owner, delegate to the engine.

Errors are raised (EngineError) and mapped to status codes in one place, `specmesh/rpc/rpc_guard.py`.
Sessions are owned and leased (`specmesh/rpc/leases.py`): StartSession returns an owner token that Verify and
EndSession must present (else PERMISSION_DENIED), and a session idle for the lease period is ended by the
service's reaper task (verifier_service/server.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import grpc

from protos.specmesh.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specmesh.config import InputLimits
from specmesh.engine.loop import EngineError
from specmesh.rpc.grpc_server import deadline_of
from specmesh.rpc.leases import SessionLeases, check_session_id
from specmesh.rpc.limits import check_token_ids
from specmesh.rpc.proto_convert import sampling_from_proto, sparse_dists_from_proto
from specmesh.spec.tree import check_parents
from verifier_service.engine import VerifierEngine
from verifier_service.forward_share import VerifyResult
from verifier_service.tenant_share import TenantShare


class LoadFields(TypedDict):
    """The cost and load fields StartSessionResponse and VerifyResponse share (gateway/verify_cost.py `reported_by`)."""
    token_cost: float
    free_tokens: int
    num_batch_tokens: int
    num_waiting: int
    num_other_rows: int
    num_other_tokens: int
    num_sessions: int


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine, model_name: str, vocab_size: int,
                 eos_token_ids: tuple[int, ...], leases: SessionLeases, max_draft_tokens: int = 64,
                 limits: InputLimits | None = None, share: TenantShare | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.leases = leases
        self.max_draft_tokens = max_draft_tokens
        self.limits = limits or InputLimits()
        self.share = share or TenantShare(engine.max_num_sessions, 0)   # per-tenant admission

    def _check_ids(self, ids: list[int], field: str) -> None:
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise EngineError("INVALID_ARGUMENT", f"{field}: token id {bad[0]} >= vocab size {self.vocab_size}")

    async def StartSession(self, request: verifier_pb2.StartSessionRequest,
                           context: grpc.aio.ServicerContext) -> verifier_pb2.StartSessionResponse:
        session_id = check_session_id(request.session_id)
        check_token_ids(len(request.prompt_token_ids), self.limits, "prompt_token_ids", "VERIFIER")
        prompt_ids = list(request.prompt_token_ids)
        self._check_ids(prompt_ids, "prompt_token_ids")
        params = sampling_from_proto(request.sampling)
        self._check_ids([t for t, _ in params.logit_bias], "sampling.logit_bias")
        if session_id not in self.leases:                 # (an open id is refused ALREADY_EXISTS just below)
            self.share.admit(session_id, request.tenant, self.leases)
        token = self.leases.open(session_id)
        try:
            with self.leases.call(session_id, token):
                result: VerifyResult = await self.engine.start_session(
                    session_id, prompt_ids, params, deadline_of(context), request.max_new_tokens,
                    request.speculative).future
        except BaseException:
            # Failed or cancelled (the caller went away): nobody holds the token, so nothing may stay open.
            self.leases.close(session_id)
            self.share.release(session_id)
            self.engine.end_session(session_id)
            raise
        return verifier_pb2.StartSessionResponse(first_token_id=result.token_ids[0], owner_token=token,
                                                 num_cached_prompt_tokens=result.num_cached_prompt_tokens,
                                                 lease_s=self.leases.lease_s, **self._load_fields(result))

    async def Verify(self, request: verifier_pb2.VerifyRequest,
                     context: grpc.aio.ServicerContext) -> verifier_pb2.VerifyResponse:
        session_id = check_session_id(request.session_id)
        if len(request.draft_token_ids) > self.max_draft_tokens:
            raise EngineError("INVALID_ARGUMENT", f"draft_token_ids has {len(request.draft_token_ids)} tokens; "
                              f"the limit is max_draft_tokens = {self.max_draft_tokens}")
        check_token_ids(sum(len(d.token_ids) for d in request.draft_dists), self.limits, "draft_dists",
                        "VERIFIER")
        with self.leases.call(session_id, request.owner_token):
            draft_ids = list(request.draft_token_ids)
            self._check_ids(draft_ids, "draft_token_ids")
            dists = sparse_dists_from_proto(request.draft_dists, len(draft_ids), self.vocab_size)
            parents = _tree_parents(request.draft_parents, len(draft_ids))
            model_drafts = request.draft_source in (common_pb2.DRAFT_SOURCE_MODEL, common_pb2.DRAFT_SOURCE_UNSPECIFIED)
            result: VerifyResult = await self.engine.verify(session_id, draft_ids, dists, deadline_of(context),
                                                            parents, model_drafts).future
        return verifier_pb2.VerifyResponse(num_accepted=result.num_accepted, token_ids=result.token_ids,
                                           accepted_node_indices=result.accepted_node_indices,
                                           **self._load_fields(result),
                                           num_free_kv_blocks=self.engine.block_manager.num_free_blocks,
                                           draining=self.engine.draining)

    def _load_fields(self, result: VerifyResult) -> LoadFields:
        """The forward's cost and load, as StartSessionResponse and VerifyResponse both carry them."""
        return {"token_cost": result.cost.token_cost, "free_tokens": result.cost.free_tokens,
                "num_batch_tokens": result.num_batch_tokens, "num_waiting": result.num_waiting,
                "num_other_rows": result.num_other_rows, "num_other_tokens": result.num_other_tokens,
                "num_sessions": len(self.engine.sessions)}

    async def EndSession(self, request: common_pb2.EndSessionRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.EndSessionResponse:
        session_id = check_session_id(request.session_id)
        self.leases.check(session_id, request.owner_token)
        self.leases.close(session_id)
        self.engine.end_session(session_id)
        return common_pb2.EndSessionResponse()

    async def KeepAlive(self, request: common_pb2.KeepAliveRequest,
                        context: grpc.aio.ServicerContext) -> common_pb2.KeepAliveResponse:
        """Renews the lease (a call that ends now) and does nothing else."""
        with self.leases.call(check_session_id(request.session_id), request.owner_token):
            pass
        return common_pb2.KeepAliveResponse(lease_s=self.leases.lease_s)

    async def GetModelInfo(self, request: verifier_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> verifier_pb2.ModelInfo:
        bm = self.engine.block_manager
        return verifier_pb2.ModelInfo(model_name=self.model_name, max_model_len=self.engine.max_model_len,
                                      vocab_size=self.vocab_size, eos_token_ids=list(self.eos_token_ids),
                                      block_size=bm.block_size, num_kv_blocks=bm.num_blocks,
                                      num_free_kv_blocks=bm.num_free_blocks,
                                      num_sessions=len(self.engine.sessions),
                                      num_waiting=self.engine.scheduler.num_waiting,
                                      draining=self.engine.draining)


def _tree_parents(draft_parents: Sequence[int], num_drafts: int) -> list[int] | None:
    """None for a chain (no parents); else the validated tree (INVALID_ARGUMENT naming the field)."""
    if not draft_parents:
        return None
    try:
        check_parents(draft_parents, num_drafts)
    except ValueError as exc:
        raise EngineError("INVALID_ARGUMENT", f"draft_parents: {exc}") from None
    return list(draft_parents)
