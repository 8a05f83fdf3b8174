"""The draft model proposer: asks the draft service over gRPC and keeps it in sync with the verified context; when
the draft service fails or is slow, the round goes on without drafts (target-only) and drafting resumes a few rounds
later (gateway/draft_link.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from gateway.cleanup import END_SESSION_RETRY_S, end_until_done
from gateway.draft_link import BACKOFF_ROUNDS, DraftLink, LinkCall, OnError
from gateway.draft_tree import build_tree, main_chain_len
from gateway.proposers.base import NO_DRAFT, Draft, Verified
from gateway.round_outcomes import RoundOutcomes
from gateway.verify_cost import UNKNOWN_COST, VerifyCost
from protos.specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specmesh.rpc.proto_convert import sampling_to_proto
from specmesh.spec.rejection import SparseDist
from specmesh.spec.sampling import SamplingParams

log = logging.getLogger(__name__)

@dataclass
class _Prefetch:
    """A Propose sent while the verifier checks `draft_ids`, for the block after them (see ModelDrafter.prefetch)."""
    context_len: int                         # verified context length when it was sent
    draft_ids: list[int]                     # the block being verified, assumed accepted
    task: asyncio.Task[draft_pb2.ProposeResponse]


@dataclass
class ModelDrafter:
    """The gateway half of the draft link: `DraftLink` (gateway/draft_link.py) decides what each Propose carries and
    what a failed one means; this class makes the calls, holds the prefetch task and counts the link's traffic."""
    stub: draft_pb2_grpc.DraftStub
    session_id: str
    sampling: SamplingParams
    timeout_s: float
    max_q_entries: int = 0
    # Chosen here and sent on every call: the Propose that creates the draft session binds it, and the service
    # refuses the session's calls without it. It binds again when the service lost the session (whole context).
    owner_token: str = field(default_factory=lambda: secrets.token_urlsafe(16), repr=False)
    link: DraftLink = field(default_factory=DraftLink)
    tree_width: int = 0                      # > 0: token trees (alternatives at low-confidence positions)
    # Prices the width each round (RoundCostModel.tree_width): max width -> width for this round.
    tree_pricing: Callable[[int], int] | None = field(default=None, repr=False)
    _round_width: int = 0
    outcomes: RoundOutcomes | None = None    # gateway-wide: whether a prefetch guessed the bonus token
    # Overlap: while a tree is verified, also prefetch the block after its likeliest alternative, on a second draft
    # session (the branch), so a rejection that takes that alternative finds its continuation drafted.
    branch_prefetch: bool = False
    num_branch_hits: int = 0
    _branch: ModelDrafter | None = field(default=None, repr=False)
    # Draft service replicas: given the replica that failed UNAVAILABLE, the one to use from now on (the session is
    # opened there by the whole-context resend that follows the backoff). None: one replica.
    reroute: Callable[[draft_pb2_grpc.DraftStub], draft_pb2_grpc.DraftStub] | None = field(default=None, repr=False)
    num_prefetch_hits: int = 0               # rounds drafted from a prefetch (no draft-link round trip waited for)
    bytes_sent: int = 0                      # serialized Propose requests / responses (the draft link's traffic)
    bytes_received: int = 0
    _prefetch: _Prefetch | None = None
    cleanup_retry_s: float = END_SESSION_RETRY_S   # EndSession retried up to this long (gateway/cleanup.py)
    # The longest context a round's Propose resends whole after NOT_FOUND (restart, lease expiry); a longer one is
    # left unbound for the caller to resend outside the round (suffix drafting: `ProposerSet.sync_in_background`).
    # None: any (the tiers, whose rounds have nothing else to draft with).
    resend_in_round_max: int | None = None

    @property
    def num_failures(self) -> int:
        return self.link.num_failures

    @property
    def skip_rounds(self) -> int:
        return self.link.backoff_rounds

    async def prefill(self, prompt_ids: list[int], num_tokens: int) -> None:
        """Propose nothing yet, but let the draft service prefill and draft `num_tokens + 1` ahead (its guess of
        the target's first token, then a block after it). Failures are left for the first real round."""
        if num_tokens <= 0:
            return
        await self._unlinked_call(prompt_ids, 0, num_tokens + 1)

    async def sync(self, context_ids: list[int], num_tokens: int, backs_off: bool = False) -> None:
        """The context, outside any round: suffix drafting's prefill, the whole context again after a failed call (to
        the replica `reroute` chose) and a long catch-up (gateway/proposers/suffix_rule.py); each sends what the link
        says the service lacks. Answered once the draft service has computed the context (the answer
        carries its first draft token, ignored; `num_tokens` more are drafted ahead), not as soon as it holds it: a
        Propose for nothing is answered at once while the prefill goes on, and the model round that followed waited
        for all of it (a ~3,900-token document: 30 s, then DEADLINE_EXCEEDED, its stream frozen meanwhile). The
        deadline grows with the context (`sync_timeout_s`). A failed prefill leaves the link unbound (no model
        round for this request); with `backs_off` a failure goes through the link as a round's call does, so a
        service that is still down backs off instead of getting the whole context every round."""
        timeout_s = sync_timeout_s(self.timeout_s, len(context_ids))
        if backs_off:
            await self._linked_call(context_ids, 1, num_tokens, timeout_s)
        else:
            await self._unlinked_call(context_ids, 1, num_tokens, timeout_s)

    async def _unlinked_call(self, context_ids: list[int], num_tokens: int, num_ahead_tokens: int,
                             timeout_s: float | None = None) -> None:
        """A prefill's Propose: its failure is not the link's (no backoff, no resend) but leaves it unbound, so the
        request gets no model round until the whole context is sent again."""
        call = self.link.send(context_ids)
        try:
            await self._call(call, num_tokens, num_ahead_tokens, timeout_s)
        except asyncio.CancelledError:
            self.link.unbind()                    # the call may or may not have reached the service
            raise
        except grpc.aio.AioRpcError:
            if call.call_id == self.link.num_calls:
                self.link.unbind()

    def _failed(self, exc: grpc.aio.AioRpcError) -> None:
        log.warning("draft service failed (%s: %s); target-only for %d rounds", exc.code().name, exc.details(),
                    BACKOFF_ROUNDS)
        if exc.code() == grpc.StatusCode.UNAVAILABLE and self.reroute is not None:
            self.stub = self.reroute(self.stub)

    def prefetch(self, context_ids: list[int], draft: Draft, num_tokens: int) -> None:
        """Called as the verifier starts on `draft`: ask now for the block after it, assuming the whole draft is
        accepted and the target's extra token equals the draft's own next guess (so ask for 1 + num_tokens). The
        answer crosses the draft link while the verifier works; `propose` uses it when the guess came true and
        otherwise drops it (the service supersedes a stale prefetch when the next Propose arrives)."""
        self._drop_prefetch()
        chain = draft.token_ids[:main_chain_len(draft.parents, len(draft.token_ids))]   # a tree: its main chain
        if num_tokens <= 0 or self.link.backoff_rounds > 0 or draft.source != common_pb2.DRAFT_SOURCE_MODEL \
                or not chain:
            return
        call = self.link.send(context_ids + chain, num_verified=len(context_ids))
        task = asyncio.ensure_future(self._call(call, num_tokens + 1))
        task.add_done_callback(functools.partial(self._prefetch_done, call))
        self._prefetch = _Prefetch(len(context_ids), chain, task)
        if self.branch_prefetch and draft.likely_branch is not None:
            self._prefetch_branch(context_ids, chain, draft.likely_branch, num_tokens)

    def _prefetch_branch(self, context_ids: list[int], chain: list[int], branch: tuple[int, int],
                         num_tokens: int) -> None:
        position, token = branch
        if self._branch is None:
            self._branch = ModelDrafter(self.stub, branch_session_id(self.session_id), self.sampling, self.timeout_s,
                                        self.max_q_entries)
        self._branch.prefetch(context_ids, Draft(chain[:position] + [token], None, common_pb2.DRAFT_SOURCE_MODEL),
                              num_tokens)

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft:
        prefetched = await self._take_prefetch(context_ids, num_tokens)
        branched = await self._branch._take_prefetch(context_ids, num_tokens) if self._branch else None
        if prefetched is None and branched is not None:
            self.num_branch_hits += 1
            if self.outcomes is not None:
                self.outcomes.branch_continuation_ready += 1
            return branched
        if prefetched is not None:
            return prefetched
        if num_tokens <= 0 or not self.link.round_allowed():
            return NO_DRAFT
        self._round_width = self.tree_pricing(self.tree_width) if self.tree_pricing else self.tree_width
        response = await self._linked_call(context_ids, num_tokens, resend_max=self.resend_in_round_max)
        return NO_DRAFT if response is None else _to_draft(response, 0, num_tokens)

    async def _linked_call(self, context_ids: list[int], num_tokens: int, num_ahead_tokens: int = 0,
                           timeout_s: float | None = None,
                           resend_max: int | None = None) -> draft_pb2.ProposeResponse | None:
        """A Propose of `context_ids` with at most one whole-context resend (the service lost the session), made
        only for contexts of at most `resend_max` tokens (None: any; a longer one is left unbound: inside a round its
        draft prefill would hold the stream); a failure goes through the link (backoff, reroute). None: no answer
        this time."""
        for _ in range(2):
            call = self.link.send(context_ids)
            try:
                return await self._call(call, num_tokens, num_ahead_tokens, timeout_s)
            except asyncio.CancelledError:
                self.link.unbind()                # the call may or may not have reached the service
                raise
            except grpc.aio.AioRpcError as exc:
                verdict = self.link.on_error(call, exc.code().name)
                if verdict is OnError.RESEND_WHOLE:
                    if resend_max is not None and len(context_ids) > resend_max:
                        return None
                    continue
                if verdict is OnError.FAILURE:
                    self._failed(exc)
                return None
        return None

    async def _take_prefetch(self, context_ids: list[int], num_tokens: int) -> Draft | None:
        """The prefetched block if the verified context is what it assumed: the whole draft, then the guess."""
        pre, self._prefetch = self._prefetch, None
        if pre is None:
            return None
        end = pre.context_len + len(pre.draft_ids)
        if num_tokens <= 0 or len(context_ids) <= end or context_ids[pre.context_len:end] != pre.draft_ids:
            return None
        try:
            response = await pre.task
        except grpc.aio.AioRpcError:
            return None
        # The target's tokens after the block: its own token, then any it decoded ahead (a greedy verifier's). The
        # prefetch drafted its guess of the first and a block after it: usable past however many of them it got right.
        target_ids = context_ids[end:]
        guessed_ids = list(response.draft_token_ids[:len(target_ids)])
        guessed = guessed_ids == target_ids
        if self.outcomes is not None:
            self.outcomes.observe_bonus(guessed_ids[:1] == target_ids[:1])
        if len(response.draft_token_ids) <= len(target_ids) or not guessed:
            return None
        self.num_prefetch_hits += 1
        return _to_draft(response, len(target_ids), num_tokens)

    @property
    def prefetching(self) -> bool:
        return self._prefetch is not None

    def _drop_prefetch(self) -> None:
        self._prefetch = None                     # its task ends (or is ABORTED) on its own; _prefetch_done reads it

    def _prefetch_done(self, call: LinkCall, task: asyncio.Task[draft_pb2.ProposeResponse]) -> None:
        """A prefetch's failure goes through the link like any call's (read here, so asyncio does not log it)."""
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, grpc.aio.AioRpcError):
            self.link.on_error(call, exc.code().name)

    async def _call(self, call: LinkCall, num_tokens: int, num_ahead_tokens: int = 0,
                    timeout_s: float | None = None) -> draft_pb2.ProposeResponse:
        request = draft_pb2.ProposeRequest(
            session_id=self.session_id, owner_token=self.owner_token, context_len=call.context_len,
            new_token_ids=call.new_token_ids, num_draft_tokens=num_tokens, sampling=sampling_to_proto(self.sampling),
            max_q_entries=self.max_q_entries, num_ahead_tokens=num_ahead_tokens,
            num_assumed_tokens=call.num_assumed_tokens, tree_width=self._round_width)
        self.bytes_sent += request.ByteSize()
        response: draft_pb2.ProposeResponse = await self.stub.Propose(request, timeout=timeout_s or self.timeout_s)
        self.bytes_received += response.ByteSize()
        return response

    def observe(self, draft: Draft, num_accepted: int, verified: Verified,
                cost: VerifyCost = UNKNOWN_COST) -> None:
        pass                                      # the next Propose carries the verified tokens

    async def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.task.cancel()
            self._prefetch = None
        if self._branch is not None:
            await self._branch.close()
        if self.bytes_sent == 0:
            return                                # never proposed (other tiers drafted): no session to end
        request = common_pb2.EndSessionRequest(session_id=self.session_id, owner_token=self.owner_token)
        await end_until_done(lambda: self.stub.EndSession(request, timeout=2.0), "draft service",
                             self.cleanup_retry_s)


def _to_draft(response: draft_pb2.ProposeResponse, start: int, num_tokens: int) -> Draft:
    """Draft positions start .. start + num_tokens - 1 of the response (a prefetch answers its guess first), with
    their alternatives as tree leaves (gateway/draft_tree.py)."""
    end = start + num_tokens
    dists = [SparseDist(tuple(d.token_ids), tuple(d.probs)) for d in response.draft_dists[start:end]] or None
    chain = list(response.draft_token_ids[start:end])
    alternatives = {a.position - start: list(a.token_ids) for a in response.alternatives if start <= a.position < end}
    ids, parents, dists = build_tree(chain, dists, alternatives)
    return Draft(ids, dists, common_pb2.DRAFT_SOURCE_MODEL, parents,
                 likely_branch(response, start, len(chain)) if parents is not None else None)


SYNC_TOKENS_PER_TIMEOUT = 1024   # a whole-context sync may take the call timeout per this many context tokens


def sync_timeout_s(timeout_s: float, num_context_tokens: int) -> float:
    """The deadline of a whole-context sync: the call timeout (30 s by default) per 1,024 context tokens, at least
    one. A ~3,900-token document took the 0.5B draft ~33 s on one AVX2 core: within 114 s, where 30 s failed it."""
    return timeout_s * max(1.0, num_context_tokens / SYNC_TOKENS_PER_TIMEOUT)


CONFIDENT = 0.9    # the draft's top-1 probability assumed where no alternatives were returned (it was >= 0.8)


def likely_branch(response: draft_pb2.ProposeResponse, start: int, num_chain: int) -> tuple[int, int] | None:
    """(position, token) of the alternative the target most likely takes: P(the path reaches the position) times
    the alternative's probability, where reaching position j needs the chain accepted before it (estimated by the
    draft's own confidence: at most 1 - the alternatives' mass where they exist, CONFIDENT elsewhere)."""
    alternatives = {a.position - start: a for a in response.alternatives
                    if start <= a.position < start + num_chain and a.token_ids and a.probs}
    reach, best, best_score = 1.0, None, 0.0
    for position in range(num_chain):
        alt = alternatives.get(position)
        if alt is None:
            reach *= CONFIDENT
            continue
        if reach * alt.probs[0] > best_score:
            best, best_score = (position, int(alt.token_ids[0])), reach * alt.probs[0]
        reach *= max(0.0, min(0.8, 1.0 - sum(alt.probs)))
    return best


def branch_session_id(session_id: str) -> str:
    """The branch session's id: the request's, marked, within the services' bound (256 bytes)."""
    return session_id.encode()[:250].decode(errors="ignore") + "~alt"
