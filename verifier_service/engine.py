"""The verifier engine: schedule -> run the target on a ragged batch -> verify drafts -> commit.

A session's state (plain ints): `token_ids` are its verified tokens (prompt + output). After each verify the
last of them, the target's own token, has no KV yet: it is run in the next forward, in front of the next drafts.
Starting a session is a verify of zero drafts, so prefill and verification share one path.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from opentelemetry.trace import SpanContext

from specmesh.engine.batched import BatchedEngine
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.loop import Completion, EngineError
from specmesh.engine.model_runner import ModelRunner
from specmesh.engine.scheduler import ForwardRequest, SeqState
from specmesh.rejection import SparseDist, rejection_sample, verify_greedy
from specmesh.sampling import SamplingParams, logits_to_probs, make_generator

log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    seq: SeqState
    params: SamplingParams
    generator: torch.Generator
    busy: bool = False           # a request of this session is queued or running
    started: bool = False        # its first token was sampled


@dataclass(frozen=True)
class VerifyResult:
    token_ids: list[int]         # accepted drafts + one target token
    num_accepted: int
    num_cached_prompt_tokens: int = 0
    num_batch_tokens: int = 0    # tokens in the forward that verified this block, all sessions together
    num_waiting: int = 0         # work items queued when it finished


@dataclass(frozen=True)
class _Start:
    session_id: str
    prompt_ids: list[int]
    params: SamplingParams
    done: Completion
    deadline: float | None = None


@dataclass(frozen=True)
class _Verify:
    session_id: str
    draft_ids: list[int]
    draft_dists: list[SparseDist] | None
    done: Completion
    deadline: float | None = None


@dataclass(frozen=True)
class _End:
    session_id: str


class VerifierEngine(BatchedEngine):
    def __init__(self, runner: ModelRunner, block_manager: BlockManager, max_model_len: int,
                 max_num_batched_tokens: int, max_num_seqs: int, max_queue_len: int, num_threads: int) -> None:
        super().__init__("verifier-engine", runner, block_manager, max_num_batched_tokens, max_num_seqs, num_threads)
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.max_num_sessions = max_num_seqs * 4
        self.sessions: dict[str, Session] = {}
        self.draining = False          # set on shutdown: running sessions finish, new ones are refused
        self._seq_ids = itertools.count()

    # ---- called from the event loop ---------------------------------------------------------------------------
    def start_session(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                      deadline: float | None = None) -> Completion:
        """deadline: time.monotonic() after which the work is dropped (DEADLINE_EXCEEDED) if not yet run."""
        done = Completion()
        self.post(_Start(session_id, prompt_ids, params, done, deadline))
        return done

    def verify(self, session_id: str, draft_ids: list[int], draft_dists: list[SparseDist] | None,
               deadline: float | None = None) -> Completion:
        done = Completion()
        self.post(_Verify(session_id, draft_ids, draft_dists, done, deadline))
        return done

    def end_session(self, session_id: str) -> None:
        self.post(_End(session_id))

    # ---- engine thread ----------------------------------------------------------------------------------------
    def handle(self, message: _Start | _Verify | _End) -> None:
        try:
            if isinstance(message, _Start):
                self._handle_start(message)
            elif isinstance(message, _Verify):
                self._handle_verify(message)
            else:
                self._close(message.session_id, EngineError("CANCELLED", "session ended"))
        except Exception as exc:       # one message's fault answers that caller only
            if not isinstance(exc, EngineError):
                log.exception("verifier: handling %s failed", type(message).__name__)
                exc = EngineError("INTERNAL", f"verifier: {exc!r}")
            if not isinstance(message, _End):
                message.done.set_exception(exc)

    def _admit(self) -> None:
        if self.scheduler.num_waiting >= self.max_queue_len:
            raise EngineError("RESOURCE_EXHAUSTED", f"verifier queue is full ({self.max_queue_len} waiting)")

    def _handle_start(self, msg: _Start) -> None:
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
        session = Session(msg.session_id, seq, msg.params, make_generator(msg.params.seed))
        self._enqueue(session, [], None, msg.done, msg.deadline)
        self.sessions[msg.session_id] = session

    def _handle_verify(self, msg: _Verify) -> None:
        self._admit()
        session = self.sessions.get(msg.session_id)
        if session is None:
            raise EngineError("NOT_FOUND", f"unknown session {msg.session_id}")
        if session.busy:
            raise EngineError("FAILED_PRECONDITION", f"session {msg.session_id} already has a verify in flight")
        room = self.max_model_len - len(session.seq.token_ids)
        if room <= 0:
            raise EngineError("OUT_OF_RANGE", f"session {msg.session_id} reached the context length")
        dists = msg.draft_dists[:room] if msg.draft_dists else None
        self._enqueue(session, msg.draft_ids[:room], dists, msg.done, msg.deadline)

    def _enqueue(self, session: Session, draft_ids: list[int], dists: list[SparseDist] | None,
                 done: Completion, deadline: float | None) -> None:
        request = ForwardRequest(session.seq, draft_ids, len(draft_ids) + 1, (session, dists, done),
                                 deadline=deadline)
        self.scheduler.enqueue(request)    # INVALID_ARGUMENT when the drafts alone exceed the step's token budget
        session.busy = True

    def _close(self, session_id: str, exc: EngineError) -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        for req in self.scheduler.release(session.seq):
            req.payload[2].set_exception(exc)

    def idle_seqs(self) -> Iterable[SeqState]:
        return (s.seq for s in self.sessions.values() if not s.busy)

    def finish(self, req: ForwardRequest, logits: torch.Tensor) -> None:
        """logits [k+1, V] for the k drafts and the position after them."""
        session, dists, done = req.payload
        seq = session.seq
        emitted = self._sample(session, logits, req.extra_ids, dists)
        num_accepted = len(emitted) - 1
        num_cached = 0 if session.started else seq.num_cached_tokens
        session.started = True
        # KV now holds every verified token plus the accepted drafts; the new target token has none yet.
        seq.num_computed = len(seq.token_ids) + num_accepted
        seq.token_ids.extend(emitted)
        seq.num_verified = len(seq.token_ids)
        self.scheduler.commit(seq)
        session.busy = False
        done.set_result(VerifyResult(emitted, num_accepted, num_cached, self.num_batch_tokens,
                                     self.scheduler.num_waiting))

    def _sample(self, session: Session, logits: torch.Tensor, draft_ids: Sequence[int],
                dists: list[SparseDist] | None) -> list[int]:
        if session.params.is_greedy:
            return verify_greedy(logits, draft_ids)
        target_probs = logits_to_probs(logits, session.params)
        draft_dists = dists if dists else [SparseDist((t,), (1.0,)) for t in draft_ids]
        return rejection_sample(target_probs, draft_ids, draft_dists, session.generator)

    def span_context(self, req: ForwardRequest) -> SpanContext:
        return req.payload[2].span_context

    def fail(self, req: ForwardRequest, exc: EngineError) -> None:
        session = req.payload[0]
        req.payload[2].set_exception(exc)
        session.busy = False
        if self.sessions.get(session.session_id) is session:
            self._close(session.session_id, exc)
