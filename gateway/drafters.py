"""Where a round's draft tokens come from. Every draft is verified the same way, so no drafter can change output.

`ModelDrafter` asks the draft service over gRPC and keeps it in sync with the verified context; when the draft
service fails or is slow, the round goes on without drafts (target-only) and drafting resumes a few rounds later.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from protos.specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specmesh.proto_convert import sampling_to_proto
from specmesh.rejection import SparseDist
from specmesh.sampling import SamplingParams

log = logging.getLogger(__name__)

BACKOFF_ROUNDS = 8   # rounds without model drafts after a draft-service failure


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    dists: list[SparseDist] | None          # None: greedy or one-hot drafts
    source: int                             # common_pb2.DraftSource


NO_DRAFT = Draft([], None, common_pb2.DRAFT_SOURCE_NONE)


class Drafter(Protocol):
    async def prefill(self, prompt_ids: list[int], num_tokens: int) -> None:
        """Runs while the verifier prefills: the draft service computes the prompt's KV and drafts ahead."""

    async def propose(self, context_ids: list[int], num_tokens: int) -> Draft: ...

    def observe(self, draft: Draft, num_accepted: int, output_ids: list[int]) -> None:
        """Told after each verify: the round's draft, how many were accepted, every verified output token."""

    async def close(self) -> None: ...


@dataclass
class ModelDrafter:
    stub: draft_pb2_grpc.DraftStub
    session_id: str
    sampling: SamplingParams
    timeout_s: float
    max_q_entries: int = 0
    num_synced: int = 0                      # context tokens the draft service already has
    skip_rounds: int = 0
    num_failures: int = field(default=0)
    bytes_sent: int = 0                      # serialized Propose requests / responses (the draft link's traffic)
    bytes_received: int = 0

    async def prefill(self, prompt_ids: list[int], num_tokens: int) -> None:
        """Propose nothing yet, but let the draft service prefill and draft `num_tokens + 1` ahead (its guess of
        the target's first token, then a block after it). Failures are left for the first real round."""
        if num_tokens <= 0:
            return
        try:
            await self._call(prompt_ids, 0, num_ahead_tokens=num_tokens + 1)
            self.num_synced = len(prompt_ids)
        except grpc.aio.AioRpcError:
            self.num_synced = 0

    async def propose(self, context_ids: list[int], num_tokens: int) -> Draft:
        if num_tokens <= 0:
            return NO_DRAFT
        if self.skip_rounds > 0:
            self.skip_rounds -= 1
            return NO_DRAFT
        try:
            response = await self._call(context_ids, num_tokens)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                return self._failed(exc)
            self.num_synced = 0                   # the draft service lost the session: resend the whole context
            try:
                response = await self._call(context_ids, num_tokens)
            except grpc.aio.AioRpcError as exc2:
                return self._failed(exc2)
        self.num_synced = len(context_ids)
        dists = [SparseDist(tuple(d.token_ids), tuple(d.probs)) for d in response.draft_dists] or None
        return Draft(list(response.draft_token_ids), dists, common_pb2.DRAFT_SOURCE_MODEL)

    async def _call(self, context_ids: list[int], num_tokens: int,
                    num_ahead_tokens: int = 0) -> draft_pb2.ProposeResponse:
        request = draft_pb2.ProposeRequest(
            session_id=self.session_id, context_len=len(context_ids), new_token_ids=context_ids[self.num_synced:],
            num_draft_tokens=num_tokens, sampling=sampling_to_proto(self.sampling), max_q_entries=self.max_q_entries,
            num_ahead_tokens=num_ahead_tokens)
        self.bytes_sent += request.ByteSize()
        response = await self.stub.Propose(request, timeout=self.timeout_s)
        self.bytes_received += response.ByteSize()
        return response

    def observe(self, draft: Draft, num_accepted: int, output_ids: list[int]) -> None:
        pass                                      # the next Propose carries the verified tokens

    def _failed(self, exc: grpc.aio.AioRpcError) -> Draft:
        self.num_failures += 1
        self.num_synced = 0                       # resync fully when drafting resumes (the service may restart)
        self.skip_rounds = BACKOFF_ROUNDS
        log.warning("draft service failed (%s: %s); target-only for %d rounds", exc.code().name, exc.details(),
                    BACKOFF_ROUNDS)
        return NO_DRAFT

    async def close(self) -> None:
        if self.bytes_sent == 0:
            return                                # never proposed (other tiers drafted): no session to end
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.stub.EndSession(common_pb2.EndSessionRequest(session_id=self.session_id), timeout=2.0)
