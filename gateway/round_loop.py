"""One generation: prefill on the verifier, then draft -> verify rounds until the request's state says it finished.

Only verified tokens leave this loop, cut at eos / max tokens by the `RequestState`. Text is produced by the caller
from the yielded tokens; a stop string it finds ends the state (`RequestState.stop_string`) and so the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from gateway.proposers.base import NO_DRAFT, Draft, Drafter
from gateway.proposers.cost_model import RoundCostModel, RoundObservation
from gateway.replicas import VerifierPool
from gateway.request_state import RequestState, RoundEvent
from gateway.round_spans import end_session_span, prefill_span, record_round, round_span
from gateway.validation import GenerationParams
from gateway.verifier_session import OnMove, SessionLost, VerifierSession
from gateway.verify_cost import reported_by
from protos.specmesh.v1 import common_pb2, verifier_pb2
from specmesh.rpc.proto_convert import sparse_dists_to_proto

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundOutput:
    round: int                 # 0 = the prefill's first token (a failover's first token: the last round's index)
    token_ids: list[int]       # newly verified tokens the client receives (cut at eos / max tokens)
    num_drafted: int
    num_accepted: int
    draft_source: int                             # common_pb2.DraftSource


async def _session_alive(call: Awaitable[verifier_pb2.VerifyResponse]) -> verifier_pb2.VerifyResponse:
    """A Verify refused for its owner token means the verifier ended this session: it was idle past the lease (the
    keep-alive could not reach it). Say so, rather than pass on a PERMISSION_DENIED the client did nothing to earn;
    the verifier's message names the internal session id, so it is not passed on."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.PERMISSION_DENIED:
            raise
        raise grpc.aio.AioRpcError(grpc.StatusCode.ABORTED, exc.initial_metadata(), exc.trailing_metadata(),
                                   "the verifier ended this request's session (idle past its lease)") from exc


@dataclass
class _NextDraft:
    """A draft asked for as soon as the previous verdict existed (overlap), for the context of that length."""
    context_len: int
    wanted: int
    task: asyncio.Future[Draft]


def _observe_round(cost_model: RoundCostModel, event: RoundEvent, state: RequestState) -> None:
    cost_model.observe(RoundObservation.of(event))   # the one place a round is learned from


class Generation:
    """Drives one request's session on a verifier replica (and the draft service); moves the session to another
    replica when its own goes away (gateway/verifier_session.py). Always `close()` it."""

    def __init__(self, params: GenerationParams, session_id: str, verifiers: VerifierPool,
                 drafter: Drafter | None, verifier_timeout_s: float, trace_context: Context | None = None,
                 cost_model: RoundCostModel | None = None, prefetch: bool = False,
                 overlap: bool = False, eos_token_ids: frozenset[int] = frozenset(), max_failovers: int = 3,
                 on_move: OnMove | None = None, other_requests: Callable[[], int] = lambda: 0) -> None:
        self.params = params
        self.other_requests = other_requests        # the gateway's other requests running now (read after the prefill)
        self.trace_context = trace_context          # the request span: parent of the prefill / round spans
        self.session_id = session_id
        self._on_move = on_move
        self.session = VerifierSession(verifiers, session_id, params.sampling, params.num_draft_tokens > 0,
                                       verifier_timeout_s, max_failovers, self._moved)
        self.drafter = drafter
        self.cost_model = cost_model                # draft length and more (None: the request's fixed k)
        self.prefetch = prefetch                    # fetch the next draft block while the verifier works
        # Overlapped speculation: the next round's draft is asked for as soon as a verdict exists (before its tokens
        # are streamed), so the draft service learns of a rejection at once and drafts while the client is served.
        self.overlap = overlap
        self._next_draft: _NextDraft | None = None
        self._draft_prefill: asyncio.Future[None] | None = None   # a prefill sent after the verifier's (see _prefill;
                                                                   # cancelled at close if still running)
        # budget, output, finish reason, round counters
        self.state = RequestState(params.prompt_ids, params.max_new_tokens, eos_token_ids, params.ignore_eos)
        if cost_model is not None:
            self.state.listeners.append(functools.partial(_observe_round, cost_model))
        if drafter is not None:
            self.state.listeners.append(lambda event, state: drafter.observe(event.draft, event.num_accepted,
                                                                              state, event.cost))

    @property
    def output_ids(self) -> list[int]:
        return self.state.output_ids

    async def rounds(self) -> AsyncIterator[RoundOutput]:
        with prefill_span(self.trace_context, len(self.params.prompt_ids)) as span:
            start = await self._prefill()
            span.set_attribute("specmesh.prefill.cached_tokens", start.num_cached_prompt_tokens)
        self.state.num_cached_prompt_tokens = start.num_cached_prompt_tokens
        first = self.state.on_first_token(start.first_token_id)
        self._start_next_draft()
        yield RoundOutput(0, first, 0, 0, common_pb2.DRAFT_SOURCE_NONE)
        while not self.state.finished:
            try:
                if self.session.should_move():
                    raise SessionLost("draining", "the replica is draining (shutting down)")
                event = await self._round(self.state.num_rounds + 1)
            except SessionLost as lost:
                yield await self._move(lost)
                continue
            tokens = self.state.on_round(event)
            self._start_next_draft()
            yield RoundOutput(event.round, tokens, len(event.draft.token_ids), event.num_accepted,
                              event.draft.source)

    async def _prefill(self) -> verifier_pb2.StartSessionResponse:
        """The verifier's prefill, and the draft service's. With the tiers the draft service prefills (and drafts
        ahead) beside the verifier. With suffix drafting the verifier's prefill comes first, alone on the cores, and
        its first token goes out without waiting for the draft's (2 cores, prompts up to 4k tokens at 0.1/s: TTFT p50
        8.9 s against target-only's 4.4 s while the two prefills shared the cores); the draft service prefills after
        it, and no model round is offered until that is done (gateway/proposers/suffix_rule.py). Beside others (or alone
        with the draft on the verifier's cores), only if a draft model round could pay at its best under the load the
        verifier reported (`RoundCostModel.model_could_pay`): a
        model that could not pay is not chosen, and its prefill only took CPU from the services sharing the host
        (8 streams of the real pair: ~1.9 s of the draft service's CPU per 16 requests that drafted 10 tokens). On the
        verifier's cores, also only if the request's tokens could repay the prefill itself, priced by the verifier's
        own prefill time (`RoundCostModel.draft_prefill_could_pay`: not for a long document with a short answer)."""
        drafter, k = self.drafter, self.params.num_draft_tokens
        if drafter is None or self.cost_model is None or self.cost_model.choice is None:
            start, _ = await asyncio.gather(self._start_session(),
                                            drafter.prefill(self.params.prompt_ids, k) if drafter else asyncio.sleep(0))
            self._observe_start(start)
            return start
        started = time.monotonic()
        start = await self._start_session()
        prefill_s = time.monotonic() - started
        self._observe_start(start)
        # Counted now, not at arrival: the first request of a burst arrived alone, but by its first token the others
        # run beside it (4 streams starting together: one draft prefill and model trials a level, for nothing).
        if self.cost_model.model_could_pay(k, alone=self.other_requests() == 0) \
                and self.cost_model.draft_prefill_could_pay(k, self.params.max_new_tokens, prefill_s):
            self._draft_prefill = asyncio.ensure_future(drafter.prefill(self.params.prompt_ids, k))
        return start

    def _observe_start(self, start: verifier_pb2.StartSessionResponse) -> None:
        if self.cost_model is not None:             # the first round is priced beside the sessions already there
            self.cost_model.observe_start(reported_by(start))

    async def _propose(self, context: list[int], num_tokens: int, room: int) -> Draft:
        """The drafter's proposal. A draft prefill sent after the verifier's runs on meanwhile: the suffix rule
        offers no model round until it is done (`ProposerSet.model_prefilling`), so no round waits for a long
        context's draft prefill (its failure unbinds the link, as an eager prefill's does)."""
        assert self.drafter is not None
        return await self.drafter.propose(context, num_tokens, room)

    async def _round(self, round_index: int) -> RoundEvent:
        """Draft, verify; the round's event (not yet applied to the state)."""
        context = self.state.context_ids
        with round_span(self.trace_context, round_index) as span:
            started = time.perf_counter()
            wanted, draft = await self._draft(context)
            drafted = time.perf_counter()
            verify = asyncio.ensure_future(self.session.verify(verify_request(draft)))
            if self.prefetch and self.drafter is not None:
                # The next block crosses the draft link while the verifier works (used if all is accepted).
                self.drafter.prefetch(context, draft, min(wanted, self.state.draft_room(len(draft.token_ids) + 1)))
            result = await _session_alive(verify)
            record_round(span, draft, result.num_accepted)
        return RoundEvent(round_index, draft, result.num_accepted, list(result.token_ids), drafted - started,
                          time.perf_counter() - drafted, result.num_waiting, result.num_batch_tokens,
                          list(result.accepted_node_indices),
                          reported_by(result))

    def _wanted_k(self) -> int:
        fixed = self.params.num_draft_tokens
        return self.cost_model.draft_length(fixed) if self.cost_model is not None else fixed

    async def _draft(self, context: list[int]) -> tuple[int, Draft]:
        """(the k wanted, the round's draft): the one started early (overlap) or asked for now. Drafting past the
        last token the client can receive is wasted work, so the draft never exceeds the room left."""
        pending, self._next_draft = self._next_draft, None
        if pending is not None and pending.context_len == len(context):
            return pending.wanted, await pending.task
        if pending is not None:
            pending.task.cancel()
        wanted = self._wanted_k()
        if self.drafter is None:
            return wanted, NO_DRAFT
        room = self.state.draft_room()
        return wanted, await self._propose(context, min(wanted, room), room)

    def _start_next_draft(self) -> None:
        if not self.overlap or self.drafter is None or self.state.remaining <= 0 or self.state.finished:
            return
        wanted = self._wanted_k()
        room = self.state.draft_room()
        task = asyncio.ensure_future(self._propose(self.state.context_ids, min(wanted, room), room))
        self._next_draft = _NextDraft(len(self.state.context_ids), wanted, task)

    async def _start_session(self) -> verifier_pb2.StartSessionResponse:
        """Opens the session on the replica placement picks (gateway/placement.py), or the next that takes it."""
        return await self.session.open(self.params.prompt_ids, self.params.max_new_tokens)

    async def _move(self, lost: SessionLost) -> RoundOutput:
        """The session again on another replica, prefilled with everything verified; its first token goes on."""
        start = await self.session.move(lost, self.state.context_ids, self.state.remaining, self.state.num_emitted)
        self._observe_start(start)                   # the next round is priced beside the new replica's sessions
        tokens = self.state.on_failover(start.first_token_id)
        self._start_next_draft()
        return RoundOutput(self.state.num_rounds, tokens, 0, 0, common_pb2.DRAFT_SOURCE_NONE)

    def _moved(self, reason: str, old: str, new: str | None, num_emitted: int) -> None:
        """A move (or a failed one) is an event on the request's span."""
        trace.get_current_span(self.trace_context).add_event("specmesh.failover", {
            "specmesh.failover.reason": reason, "specmesh.failover.from": old,
            "specmesh.failover.to": new or "", "specmesh.failover.tokens_emitted": num_emitted})
        if self._on_move is not None:
            self._on_move(reason, old, new, num_emitted)

    async def close(self) -> None:
        """Release the session everywhere; runs even when the client went away. A verifier session that never
        started has no token and needs no EndSession (a StartSession that failed or was cancelled ends itself)."""
        # The client stopped reading: the early draft is not needed, nor a draft prefill still running.
        for task in (self._next_draft.task if self._next_draft else None, self._draft_prefill):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._next_draft = self._draft_prefill = None
        with end_session_span(self.trace_context):
            calls: list[Awaitable[object]] = [self.session.close()]
            if self.drafter is not None:
                calls.append(self.drafter.close())
            results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                log.warning("ending session %s: %r", self.session_id, r)


def verify_request(draft: Draft) -> verifier_pb2.VerifyRequest:
    """A round's VerifyRequest (the session fills in its id and owner token): the drafts, their q, a tree's shape and
    where they came from (the verifier leaves the draft service its core only while the model drafts)."""
    request = verifier_pb2.VerifyRequest(draft_token_ids=draft.token_ids,
                                         draft_dists=sparse_dists_to_proto(draft.dists or []),
                                         draft_source=common_pb2.DraftSource.Name(draft.source))
    if draft.parents is not None:                   # a tree (empty draft_parents on the wire = a chain)
        request.draft_parents.extend(draft.parents)
    return request
