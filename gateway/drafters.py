"""Where a round's draft tokens come from. Every draft is verified the same way, so no drafter can change output.

`ModelDrafter` asks the draft service over gRPC and keeps it in sync with the verified context; when the draft
service fails or is slow, the round goes on without drafts (target-only) and drafting resumes a few rounds later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from protos.specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specmesh.proto_convert import sampling_to_proto
from specmesh.rejection import SparseDist
from specmesh.sampling import SamplingParams
from specmesh.token_ids import common_prefix_len

log = logging.getLogger(__name__)

BACKOFF_ROUNDS = 8   # rounds without model drafts after a draft-service failure


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    dists: list[SparseDist] | None          # None: greedy or one-hot drafts
    source: int                             # common_pb2.DraftSource
    # A token tree: parents[i] = index of node i's parent among the drafts, -1 = a child of the pending token;
    # topological (parents[i] < i). None = a chain ([-1, 0, 1, ..., k-2]), today's drafts.
    parents: list[int] | None = None


NO_DRAFT = Draft([], None, common_pb2.DRAFT_SOURCE_NONE)


class Drafter(Protocol):
    async def prefill(self, prompt_ids: list[int], num_tokens: int) -> None:
        """Runs while the verifier prefills: the draft service computes the prompt's KV and drafts ahead."""

    async def propose(self, context_ids: list[int], num_tokens: int) -> Draft: ...

    def prefetch(self, context_ids: list[int], draft: Draft, num_tokens: int) -> None:
        """Told when the verifier starts on `draft`: may start fetching the block after it (a guess)."""

    def observe(self, draft: Draft, num_accepted: int, output_ids: list[int]) -> None:
        """Told after each verify: the round's draft, how many were accepted, every verified output token."""

    async def close(self) -> None: ...


@dataclass
class _Prefetch:
    """A Propose sent while the verifier checks `draft_ids`, for the block after them (see ModelDrafter.prefetch)."""
    context_len: int                         # verified context length when it was sent
    draft_ids: list[int]                     # the block being verified, assumed accepted
    task: asyncio.Task[draft_pb2.ProposeResponse]


@dataclass
class ModelDrafter:
    stub: draft_pb2_grpc.DraftStub
    session_id: str
    sampling: SamplingParams
    timeout_s: float
    max_q_entries: int = 0
    # Chosen here and sent on every call: the Propose that creates the draft session binds it, and the service
    # refuses the session's calls without it. It binds again when the service lost the session (whole context).
    owner_token: str = field(default_factory=lambda: secrets.token_urlsafe(16), repr=False)
    # What the draft service holds as its context: `num_synced` tokens of the verified context, then `spec_ids`
    # (draft tokens a prefetch told it to assume accepted). The next call sends everything after the longest
    # prefix of that which is still right.
    num_synced: int = 0
    spec_ids: list[int] = field(default_factory=list)
    skip_rounds: int = 0
    num_failures: int = field(default=0)
    num_prefetch_hits: int = 0               # rounds drafted from a prefetch (no draft-link round trip waited for)
    bytes_sent: int = 0                      # serialized Propose requests / responses (the draft link's traffic)
    bytes_received: int = 0
    _prefetch: _Prefetch | None = None
    _num_calls: int = 0

    async def prefill(self, prompt_ids: list[int], num_tokens: int) -> None:
        """Propose nothing yet, but let the draft service prefill and draft `num_tokens + 1` ahead (its guess of
        the target's first token, then a block after it). Failures are left for the first real round."""
        if num_tokens <= 0:
            return
        try:
            await self._call(prompt_ids, 0, num_ahead_tokens=num_tokens + 1)
        except grpc.aio.AioRpcError:
            self._desync()

    def prefetch(self, context_ids: list[int], draft: Draft, num_tokens: int) -> None:
        """Called as the verifier starts on `draft`: ask now for the block after it, assuming the whole draft is
        accepted and the target's extra token equals the draft's own next guess (so ask for 1 + num_tokens). The
        answer crosses the draft link while the verifier works; `propose` uses it when the guess came true and
        otherwise drops it (the service supersedes a stale prefetch when the next Propose arrives)."""
        self._drop_prefetch()
        if num_tokens <= 0 or self.skip_rounds > 0 or draft.source != common_pb2.DRAFT_SOURCE_MODEL \
                or not draft.token_ids:
            return
        task = asyncio.ensure_future(self._call(context_ids + draft.token_ids, num_tokens + 1,
                                                num_verified=len(context_ids)))
        task.add_done_callback(_swallow)
        self._prefetch = _Prefetch(len(context_ids), list(draft.token_ids), task)

    async def propose(self, context_ids: list[int], num_tokens: int) -> Draft:
        prefetched = await self._take_prefetch(context_ids, num_tokens)
        if prefetched is not None:
            return prefetched
        if num_tokens <= 0:
            return NO_DRAFT
        if self.skip_rounds > 0:
            self.skip_rounds -= 1
            return NO_DRAFT
        try:
            response = await self._call(context_ids, num_tokens)
        except grpc.aio.AioRpcError as exc:
            # _call has dropped the sync state, so the next call resends the whole context.
            if exc.code() == grpc.StatusCode.ABORTED:       # overtaken by a stale prefetch: skip one round
                return NO_DRAFT
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                return self._failed(exc)
            try:                                  # the draft service lost the session: resend the whole context
                response = await self._call(context_ids, num_tokens)
            except grpc.aio.AioRpcError as exc2:
                return self._failed(exc2)
        return _to_draft(response.draft_token_ids, response.draft_dists)

    async def _take_prefetch(self, context_ids: list[int], num_tokens: int) -> Draft | None:
        """The prefetched block if the verified context is what it assumed: the whole draft, then the guess."""
        pre, self._prefetch = self._prefetch, None
        if pre is None:
            return None
        end = pre.context_len + len(pre.draft_ids)
        if num_tokens <= 0 or len(context_ids) != end + 1 or context_ids[pre.context_len:end] != pre.draft_ids:
            return None
        try:
            response = await pre.task
        except grpc.aio.AioRpcError:
            return None
        if len(response.draft_token_ids) < 2 or response.draft_token_ids[0] != context_ids[-1]:
            return None
        self.num_prefetch_hits += 1
        return _to_draft(response.draft_token_ids[1:1 + num_tokens], response.draft_dists[1:1 + num_tokens])

    @property
    def prefetching(self) -> bool:
        return self._prefetch is not None

    def _drop_prefetch(self) -> None:
        self._prefetch = None                     # its task finishes (or is ABORTED) on its own; _swallow reads it

    async def _call(self, context_ids: list[int], num_tokens: int, num_ahead_tokens: int = 0,
                    num_verified: int | None = None) -> draft_pb2.ProposeResponse:
        """Proposes after `context_ids`; its first `num_verified` tokens (default all) are verified, the rest are
        assumed. The sync state is updated when the request is sent: a later call may go out before this one's
        answer arrives, and the service handles a session's calls in order."""
        base = self.num_synced + common_prefix_len(self.spec_ids, context_ids[self.num_synced:])
        base = min(base, len(context_ids))
        verified = len(context_ids) if num_verified is None else num_verified
        request = draft_pb2.ProposeRequest(
            session_id=self.session_id, owner_token=self.owner_token, context_len=len(context_ids),
            new_token_ids=context_ids[base:],
            num_draft_tokens=num_tokens, sampling=sampling_to_proto(self.sampling), max_q_entries=self.max_q_entries,
            num_ahead_tokens=num_ahead_tokens, num_assumed_tokens=len(context_ids) - verified)
        self.num_synced, self.spec_ids = verified, list(context_ids[verified:])
        self._num_calls += 1
        call = self._num_calls
        self.bytes_sent += request.ByteSize()
        try:
            response = await self.stub.Propose(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError:
            if call == self._num_calls:           # a later call's sync state stands (e.g. it superseded this one)
                self._desync()
            raise
        self.bytes_received += response.ByteSize()
        return response

    def _desync(self) -> None:
        self.num_synced, self.spec_ids = 0, []

    def observe(self, draft: Draft, num_accepted: int, output_ids: list[int]) -> None:
        pass                                      # the next Propose carries the verified tokens

    def _failed(self, exc: grpc.aio.AioRpcError) -> Draft:
        self.num_failures += 1
        self._desync()                            # resync fully when drafting resumes (the service may restart)
        self.skip_rounds = BACKOFF_ROUNDS
        log.warning("draft service failed (%s: %s); target-only for %d rounds", exc.code().name, exc.details(),
                    BACKOFF_ROUNDS)
        return NO_DRAFT

    async def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.task.cancel()
            self._prefetch = None
        if self.bytes_sent == 0:
            return                                # never proposed (other tiers drafted): no session to end
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.stub.EndSession(common_pb2.EndSessionRequest(session_id=self.session_id,
                                                                    owner_token=self.owner_token), timeout=2.0)


def _to_draft(token_ids: Sequence[int], dists: Sequence[common_pb2.SparseDist]) -> Draft:
    return Draft(list(token_ids), [SparseDist(tuple(d.token_ids), tuple(d.probs)) for d in dists] or None,
                 common_pb2.DRAFT_SOURCE_MODEL)


def _swallow(task: asyncio.Task[draft_pb2.ProposeResponse]) -> None:
    """A dropped prefetch's outcome is not needed; reading it keeps asyncio from logging it as unretrieved."""
    if not task.cancelled():
        task.exception()
