"""The verifier engine: schedule -> run the target on a ragged batch -> verify drafts -> commit.

A session's state (plain ints): `token_ids` are its verified tokens (prompt + output). After each verify the
last of them, the target's own token, has no KV yet: it is run in the next forward, in front of the next drafts.
Starting a session is a verify of zero drafts, so prefill and verification share one path.

Token trees (`specmesh/spec/tree.py`): a verify with `parents` runs `[pending token, node 0, ..., node n-1]` in one
forward with an ancestor mask (`ForwardItem.tree_parents`); all n + 1 tokens need logits, so the scheduler never
splits them. Node i's KV lands in the slot of its index (position len(token_ids) + i). After sampling, the accepted
path's KV is moved to contiguous positions (`ModelRunner.move_kv`), and the usual truncate drops the rest, so the
block manager sees exactly what a chain verify would leave.

Decoding ahead (`verifier_service/ahead.py`): idle sessions decode the target's own next tokens, up to
`ahead.max_tokens` past what the caller has received (`Session.num_delivered`): greedy and seeded sessions always,
unseeded sampled ones unless they draft with the draft model (`decode_ahead.may_decode_ahead`). Those tokens join
`token_ids` like any verified token (they are what target-only decoding emits: the argmax, the seeded draw, or a
draw from p); the next verify checks its drafts against them first and leaves with all of them, so the target never
waits for a draft.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from opentelemetry.trace import SpanContext

from specmesh.engine.batched import BatchedEngine
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.forward_cost import Fit
from specmesh.engine.loop import Completion, EngineError
from specmesh.engine.model_runner import ForwardItem, ModelRunner
from specmesh.engine.scheduled import ScheduledItem, SeqState
from specmesh.spec.rejection import SparseDist
from specmesh.spec.sampling import SamplingParams, make_generator
from specmesh.spec.tree import keep_shallow
from specmesh.telemetry.metrics import StatsCollector
from verifier_service.ahead import agrees_with_guesses, match_ahead
from verifier_service.decode_ahead import DecodeAhead
from verifier_service.forward_share import ForwardShare, VerifyResult
from verifier_service.gather import ReturnGather
from verifier_service.messages import AHEAD_STEP, NO_CALLER, Caller, Drafts, End, Start, Verify, VerifyRequest
from verifier_service.session import Session
from verifier_service.verdicts import chain_verdict, tree_verdict

log = logging.getLogger(__name__)


class VerifierEngine(BatchedEngine[VerifyRequest]):
    def __init__(self, runner: ModelRunner, block_manager: BlockManager, max_model_len: int,
                 max_num_batched_tokens: int, max_num_seqs: int, max_queue_len: int, num_threads: int,
                 max_ahead_tokens: int = 0, eos_token_ids: Iterable[int] = ()) -> None:
        super().__init__("verifier-engine", runner, block_manager, max_num_batched_tokens, max_num_seqs, num_threads)
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.ahead = DecodeAhead(max_ahead_tokens, max_model_len, self.eos_token_ids)   # idle sessions
        self.metrics.registry.register(StatsCollector({"verifier": self.ahead.counts.stats}))
        self._ahead_beside_drafts = False          # the step only decodes ahead, for a session that drafts
        self._ahead_stalled = False                # the last ahead step could run none: wait for a message
        # Sessions whose message needs a forward, added from the event loop as it arrives: a step that only decodes
        # ahead for some of them and nobody else gives way between layers (see interrupt_check).
        self._urgent_ids: set[str] = set()
        # The guesses of the ahead step now running, per session (replaced whole by the engine thread; read from
        # the event loop by `verify`): a verify whose drafts agree with them waits for that step (see verify).
        self._ahead_in_flight: dict[str, list[int]] = {}
        self.max_queue_len = max_queue_len
        self.max_num_sessions = max_num_seqs * 4
        self.sessions: dict[str, Session] = {}
        self.share = ForwardShare()    # each answer says what the other sessions had of its forward
        self.gather = ReturnGather()   # waits a moment for the sessions a forward answered (streams share forwards)
        self.draining = False          # set on shutdown: running sessions finish, new ones are refused
        self._seq_ids = itertools.count()

    # ---- called from the event loop ---------------------------------------------------------------------------
    def start_session(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                      deadline: float | None = None, max_new_tokens: int = 0,
                      speculative: bool = False) -> Completion[VerifyResult]:
        """deadline: time.monotonic() after which the work is dropped (DEADLINE_EXCEEDED) if not yet run;
        max_new_tokens: the most the caller will take (0 = up to the context length), a bound on decoding ahead;
        speculative: the caller drafts for this session (decoding ahead may guess in rounds without drafts too).
        A start waits for a step that decodes ahead for running sessions (one forward at most), never abandons it."""
        done: Completion[VerifyResult] = Completion()
        self.post(Start(session_id, prompt_ids, params, done, deadline, max_new_tokens, speculative))
        return done

    def verify(self, session_id: str, draft_ids: list[int], draft_dists: list[SparseDist] | None,
               deadline: float | None = None, draft_parents: list[int] | None = None,
               model_drafts: bool = True) -> Completion[VerifyResult]:
        """draft_parents: a token tree over draft_ids (validated by the caller; None = chain). model_drafts: the
        draft service made them (it may be drafting this session's next block now; n-gram and cache drafts: False)."""
        done: Completion[VerifyResult] = Completion()
        if draft_ids and not self._ahead_serves(session_id, draft_ids, draft_parents):
            self._urgent_ids.add(session_id)
        self.post(Verify(session_id, draft_ids, draft_dists, done, deadline, draft_parents, model_drafts))
        return done

    def _ahead_serves(self, session_id: str, draft_ids: list[int], draft_parents: list[int] | None) -> bool:
        """Whether decoding ahead serves this verify, so a step that decodes ahead need not give way to it: the tokens
        decoded so far settle it without a forward, or the step now running carries prompt-lookup guesses that agree
        with its drafts (`agrees_with_guesses`: one stream of the real pair on a 2-core Zen 4, the gateway's suffix
        drafts, lookups in the same context, arrived ~5 ms into the ahead steps that carried guesses and stopped all
        but ~10 of ~70 a pass, to verify the same tokens again in a forward of their own). Read from the event loop
        while the engine thread may add a token or start a step: a stale answer only decides whether the step gives
        way."""
        session = self.sessions.get(session_id)
        if session is None:
            return False
        ahead_ids = session.seq.token_ids[session.num_delivered:]
        if ahead_ids and match_ahead(ahead_ids, draft_ids, draft_parents).resolved:
            return True
        return agrees_with_guesses(ahead_ids, draft_ids, draft_parents, self._ahead_in_flight.get(session_id, []))

    def end_session(self, session_id: str) -> None:
        self.post(End(session_id))

    # ---- engine thread ----------------------------------------------------------------------------------------
    def handle(self, message: Start | Verify | End) -> None:
        self._ahead_stalled = False
        self._urgent_ids.clear()
        try:
            if isinstance(message, Start):
                self._handle_start(message)
            elif isinstance(message, Verify):
                self._handle_verify(message)
            else:
                self._close(message.session_id, EngineError("CANCELLED", "session ended"))
        except Exception as exc:       # one message's fault answers that caller only
            if not isinstance(exc, EngineError):
                log.exception("verifier: handling %s failed", type(message).__name__)
                exc = EngineError("INTERNAL", f"verifier: {exc!r}")
            if not isinstance(message, End):
                message.done.set_exception(exc)

    def _admit(self) -> None:
        if self.scheduler.num_waiting >= self.max_queue_len:
            raise EngineError("RESOURCE_EXHAUSTED", f"verifier queue is full ({self.max_queue_len} waiting)")

    def _handle_start(self, msg: Start) -> None:
        if self.draining:
            raise EngineError("UNAVAILABLE", "verifier is draining (shutting down): retry on another replica")
        self._admit()
        if msg.session_id in self.sessions:
            raise EngineError("ALREADY_EXISTS", f"session {msg.session_id} already exists")
        if len(self.sessions) >= self.max_num_sessions:
            raise EngineError("RESOURCE_EXHAUSTED", f"verifier holds {len(self.sessions)} sessions (the maximum)")
        if not 0 < len(msg.prompt_ids) < self.max_model_len:
            raise EngineError("INVALID_ARGUMENT", f"prompt has {len(msg.prompt_ids)} tokens; the context holds "
                              f"{self.max_model_len}")
        seq = SeqState(next(self._seq_ids), list(msg.prompt_ids), num_verified=len(msg.prompt_ids))
        max_len = len(msg.prompt_ids) + msg.max_new_tokens if msg.max_new_tokens > 0 else self.max_model_len
        session = Session(msg.session_id, seq, msg.params, make_generator(msg.params.seed), max_len,
                          num_delivered=len(msg.prompt_ids), speculative=msg.speculative)
        self._enqueue(session, [], Drafts(None), msg.done, msg.deadline)
        self.sessions[msg.session_id] = session

    def _handle_verify(self, msg: Verify) -> None:
        self._admit()
        session = self.sessions.get(msg.session_id)
        if session is None:
            raise EngineError("NOT_FOUND", f"unknown session {msg.session_id}")
        if session.busy:
            raise EngineError("FAILED_PRECONDITION", f"session {msg.session_id} already has a verify in flight")
        self.gather.returned(msg.session_id, msg.done.submitted_at)
        self.scheduler.check_fits(len(msg.draft_ids) + 1)     # refused alike whether or not it needs a forward
        session.verifies_since_model = 0 if msg.draft_ids and msg.model_drafts else session.verifies_since_model + 1
        ahead_ids = session.seq.token_ids[session.num_delivered:]
        if not ahead_ids:
            self._enqueue_in_room(session, msg, msg.draft_ids, msg.draft_dists, msg.draft_parents)
            return
        # Decoded ahead of the caller (decode_ahead.may_decode_ahead): the drafts meet those tokens first. Either
        # that settles the verdict (answered at once, with every token decoded ahead) or the drafts below them are
        # verified from the last one, with their own draft probabilities (a sampled session's rejection sampling).
        match = match_ahead(ahead_ids, msg.draft_ids, msg.draft_parents)
        if match.resolved:
            self.ahead.delivered(session, len(ahead_ids))
            msg.done.set_result(VerifyResult(ahead_ids, len(match.path), tuple(match.path),
                                              num_batch_tokens=0, num_waiting=self.scheduler.num_waiting,
                                              cost=self._verify_fit(len(msg.draft_ids) + 1)))
            return
        rest_dists = [msg.draft_dists[i] for i in match.rest_indices] if msg.draft_dists else None
        self._enqueue_in_room(session, msg, match.rest_ids, rest_dists, match.rest_parents, match.rest_indices,
                              tuple(match.path))

    def _enqueue_in_room(self, session: Session, msg: Verify, draft_ids: list[int],
                         dists: list[SparseDist] | None, parents: list[int] | None,
                         indices: list[int] | None = None, ahead_path: tuple[int, ...] = ()) -> None:
        """Queue the drafts that fit the context (a tree keeps its shallow nodes: paths end at the context length).
        indices: draft i -> its index in the request (None: the same)."""
        room = self.max_model_len - len(session.seq.token_ids)
        if room <= 0:
            raise EngineError("OUT_OF_RANGE", f"session {msg.session_id} reached the context length")
        if parents is None:
            kept = list(range(min(len(draft_ids), room)))
        else:
            kept, parents = keep_shallow(parents, room)
        node_indices = kept if indices is None else [indices[i] for i in kept]
        drafts = Drafts([dists[i] for i in kept] if dists else None, parents, node_indices, ahead_path)
        self._enqueue(session, [draft_ids[i] for i in kept], drafts, msg.done, msg.deadline)

    def _enqueue(self, session: Session, draft_ids: list[int], drafts: Drafts,
                 done: Caller, deadline: float | None) -> None:
        request = VerifyRequest(session.seq, draft_ids, len(draft_ids) + 1, deadline=deadline, session=session,
                                drafts=drafts, done=done)
        self.scheduler.enqueue(request)    # INVALID_ARGUMENT when the drafts alone exceed the step's token budget
        session.busy = True

    def _close(self, session_id: str, exc: EngineError) -> None:
        self.gather.forget(session_id)
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        for req in self.scheduler.release(session.seq):
            req.done.set_exception(exc)

    def idle_seqs(self) -> Iterable[SeqState]:
        return (s.seq for s in self.sessions.values() if not s.busy)

    # ---- decoding ahead ---------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.num_waiting > 0 or (not self._ahead_stalled and bool(self._ahead_sessions()))

    def step(self) -> None:
        """Idle sessions decode one token ahead each, in the step's one forward beside whatever waits (a
        verify's rows, a prompt's chunks), plus the guesses that fit the forward's free rows. Their requests never
        outlive the step, so a verify arriving next finds none of them queued. Beside a waiting verify a row costs
        a fraction of the forward it joins (int4, 2 cores: 8 rows 76 ms, 1 row 47 ms); held back, the 7 idle streams
        of 8 lost a forward to each verify of n-gram drafts, which then ran alone."""
        ahead = self._ahead_sessions()
        self._ahead_beside_drafts = any(s.drafting for s in ahead) and not self.scheduler.num_waiting
        waiting_rows = sum(r.num_logits for r in self.scheduler if self.scheduler.is_decode(r))
        threads = self.threads_for(waiting_rows + len(ahead))
        guesses = self.ahead.guesses_for(ahead, self.forward_cost.fit(threads), waiting_rows,
                                         functools.partial(self.forward_cost.seconds, threads))
        requests = [VerifyRequest(s.seq, g, len(g) + 1, session=s, drafts=AHEAD_STEP, done=NO_CALLER)
                    for s, g in zip(ahead, guesses, strict=True)]
        for request in requests:                    # (not `busy`: a verify arriving next finds none of them)
            self.scheduler.enqueue(request)
        self._ahead_in_flight = {s.session_id: g for s, g in zip(ahead, guesses, strict=True) if g}
        try:
            super().step()
        finally:
            self._ahead_in_flight = {}
            unscheduled = [r for r in requests if self.scheduler.remove(r)]     # no KV room: never mind
            # none could run: wait for the next message rather than spin on them
            self._ahead_stalled = bool(requests) and len(unscheduled) == len(requests)

    def _verify_fit(self, num_tokens: int) -> Fit:
        """The measured cost on the threads a verify of `num_tokens` tokens runs on (what a caller prices by)."""
        return self.forward_cost.fit(BatchedEngine.threads_for(self, num_tokens))

    def interrupt_check(self, batch: list[ScheduledItem[VerifyRequest]]) -> Callable[[], bool] | None:
        """A step that only decodes ahead gives way to a verify that needs a forward, when it decodes ahead for
        that verify's session alone (one stream: the verify runs at once). Beside other sessions' rows it runs on:
        giving way would throw away their tokens, a whole forward of work (ahead steps of 4 streams gave way to 68
        n-gram verifies in 20 s, 4% of the verifier's time), to save one session part of a forward's wait."""
        if not batch or not all(item.request.drafts.is_ahead_step for item in batch):
            return None
        session_ids = frozenset(item.request.session.session_id for item in batch)
        return lambda: session_ids <= self._urgent_ids     # (a C-level subset test: safe beside the loop's add)

    def interrupted(self, request: VerifyRequest) -> None:
        """Only steps that decode ahead give way: nobody waits for them; the token is simply not decoded yet."""
        self.ahead.counts.interrupted += 1

    def threads_for(self, num_tokens: int) -> int:
        """A step that only decodes ahead while a draft is being made runs on `ahead.threads` (when set): on a host
        shared with the draft service, the draft's core stays free while the verifier merely gets ahead."""
        if self._ahead_beside_drafts and self.ahead.threads > 0:
            return self.ahead.threads
        return super().threads_for(num_tokens)

    def _ahead_sessions(self) -> list[Session]:
        return self.ahead.sessions(self.sessions.values(), self.block_manager)

    def _forward_item(self, item: ScheduledItem[VerifyRequest]) -> ForwardItem:
        forward_item = super()._forward_item(item)
        self.share.ran(item.request, len(item.token_ids))
        parents = item.request.drafts.parents
        if parents is None or not item.is_final:
            return forward_item
        return dataclasses.replace(forward_item, tree_parents=parents)

    def finish(self, req: VerifyRequest, logits: torch.Tensor) -> None:
        """logits [n+1, V] for the pending token and the n drafts (chain or tree nodes)."""
        session, drafts = req.session, req.drafts
        seq = session.seq
        if drafts.is_ahead_step:             # the pending token's next token, after any guesses it confirms
            emitted = self._sample(req, session, logits, None)       # guesses are one-hot drafts
            self._commit(session, emitted, len(emitted) - 1)
            self.ahead.decoded(session, len(req.extra_ids), len(emitted) - 1)
            self.share.emitted(len(emitted))
            return
        if drafts.parents is None:
            emitted = self._sample(req, session, logits, drafts.dists)
            accepted = list(range(len(emitted) - 1))
        else:
            accepted, final = self._sample_tree(session, logits, req.extra_ids, drafts.parents, drafts.dists)
            self._keep_path(seq, accepted)
            emitted = [req.extra_ids[i] for i in accepted] + [final]
        if drafts.node_indices is not None:
            accepted = [drafts.node_indices[i] for i in accepted]
        num_cached = 0 if session.started else seq.num_cached_tokens
        session.started = True
        first_new = session.num_delivered
        self._commit(session, emitted, len(emitted) - 1)
        self.ahead.delivered(session, len(drafts.ahead_path))
        path = list(drafts.ahead_path) + accepted
        self.share.hold(req, req.done, VerifyResult(seq.token_ids[first_new:], len(path), tuple(path), num_cached,
                                                self.num_batch_tokens, self.scheduler.num_waiting,
                                                self.forward_cost.fit(self.forward_threads)), len(emitted))

    def finish_batch(self, requests: list[VerifyRequest], logits: torch.Tensor) -> None:
        try:
            super().finish_batch(requests, logits)
        finally:                             # the answers go out with what the other sessions had of the forward
            self.share.release(self.num_batch_tokens)
            ended = time.monotonic()
            answered = [r.session.session_id for r in requests if not r.drafts.is_ahead_step]
            self.gather.forward_done(answered, ended - self.forward_s, ended)

    def gather_wait_s(self) -> float:
        """With work queued, a moment for the sessions the last forward answered to join it (gather.py)."""
        return self.gather.wait_s(time.monotonic()) if self.scheduler.num_waiting else 0.0

    def _commit(self, session: Session, emitted: list[int], num_accepted: int) -> None:
        """KV now holds every verified token plus the accepted drafts; the new target token has none yet."""
        seq = session.seq
        seq.num_computed = len(seq.token_ids) + num_accepted
        seq.token_ids.extend(emitted)
        seq.num_verified = len(seq.token_ids)
        self.scheduler.commit(seq)
        session.busy = False

    def _keep_path(self, seq: SeqState, accepted: list[int]) -> None:
        """Move the accepted nodes' KV from the slots of their tree index to contiguous positions.

        Node i ran at position base + i (base = len(token_ids)); the path's j-th node belongs at base + j. Path
        indices increase and a_j >= j, so no move overwrites a later move's source."""
        base = len(seq.token_ids)
        moves = [(base + a, base + j) for j, a in enumerate(accepted) if a != j]
        if not moves:
            return
        slots = self.block_manager.slot_mapping(seq.seq_id, base, base + accepted[-1] + 1)
        self.runner.move_kv([slots[src - base] for src, _ in moves], [slots[dst - base] for _, dst in moves])

    def _sample_tree(self, session: Session, logits: torch.Tensor, node_ids: Sequence[int], parents: Sequence[int],
                     dists: list[SparseDist] | None) -> tuple[list[int], int]:
        return tree_verdict(session, logits, node_ids, parents, dists)

    def _sample(self, req: VerifyRequest, session: Session, logits: torch.Tensor,
                dists: list[SparseDist] | None) -> list[int]:
        return chain_verdict(session, logits, req.extra_ids, dists, lambda: self.argmax_rows(req))

    def span_context(self, req: VerifyRequest) -> SpanContext | None:
        return req.done.span_context

    def submitted_at(self, req: VerifyRequest) -> float | None:
        return req.done.submitted_at

    def fail(self, req: VerifyRequest, exc: EngineError) -> None:
        session = req.session
        req.done.set_exception(exc)
        session.busy = False
        if req.drafts.is_ahead_step:     # nobody asked for it: the session goes on (its KV is recomputed)
            return
        if self.sessions.get(session.session_id) is session:
            self._close(session.session_id, exc)
