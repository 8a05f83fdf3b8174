"""The draft engine: proposes k tokens per session from the small model, batched across sessions.

Each session keeps the verified context it was sent plus the tokens it proposed. A new Propose call carries the
newly verified tokens; the session keeps the KV of its longest prefix that still matches the verified context
(accepted drafts keep their KV), drops the rest, and drafts from there, one batched forward per draft position.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from specmesh.engine.batched import BatchedEngine
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.loop import Completion, EngineError
from specmesh.engine.model_runner import ModelRunner
from specmesh.engine.scheduler import ForwardRequest, SeqState
from specmesh.rejection import SparseDist
from specmesh.sampling import SamplingParams, logits_to_probs, make_generator, sample_sparse, sparsify


@dataclass
class DraftSession:
    session_id: str
    seq: SeqState
    generator: torch.Generator
    busy: bool = False


@dataclass
class Proposal:
    session: DraftSession
    num_draft_tokens: int
    params: SamplingParams
    max_q_entries: int
    done: Completion
    draft_ids: list[int] = field(default_factory=list)
    draft_dists: list[SparseDist] = field(default_factory=list)


@dataclass(frozen=True)
class _Propose:
    session_id: str
    context_len: int
    new_token_ids: list[int]
    num_draft_tokens: int
    params: SamplingParams
    max_q_entries: int
    done: Completion


@dataclass(frozen=True)
class _End:
    session_id: str


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftEngine(BatchedEngine):
    def __init__(self, runner: ModelRunner, block_manager: BlockManager, max_model_len: int,
                 max_num_batched_tokens: int, max_num_seqs: int, max_queue_len: int, num_threads: int) -> None:
        super().__init__("draft-engine", runner, block_manager, max_num_batched_tokens, max_num_seqs, num_threads)
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.max_num_sessions = max_num_seqs * 4
        self.sessions: dict[str, DraftSession] = {}
        self._seq_ids = itertools.count()

    # ---- called from the event loop ---------------------------------------------------------------------------
    def propose(self, session_id: str, context_len: int, new_token_ids: list[int], num_draft_tokens: int,
                params: SamplingParams, max_q_entries: int) -> Completion:
        done = Completion()
        self.post(_Propose(session_id, context_len, new_token_ids, num_draft_tokens, params, max_q_entries, done))
        return done

    def end_session(self, session_id: str) -> None:
        self.post(_End(session_id))

    # ---- engine thread ----------------------------------------------------------------------------------------
    def handle(self, message: _Propose | _End) -> None:
        if isinstance(message, _End):
            session = self.sessions.pop(message.session_id, None)
            if session is not None:
                for req in self.scheduler.waiting:
                    if req.seq is session.seq:
                        req.payload.done.set_exception(EngineError("CANCELLED", "session ended"))
                self.scheduler.release(session.seq)
            return
        try:
            self._handle_propose(message)
        except EngineError as exc:
            message.done.set_exception(exc)

    def _session_for(self, msg: _Propose) -> DraftSession:
        session = self.sessions.get(msg.session_id)
        if session is None:
            if msg.context_len != len(msg.new_token_ids):
                raise EngineError("NOT_FOUND", f"unknown draft session {msg.session_id}: send the whole context")
            if len(self.sessions) >= self.max_num_sessions:
                raise EngineError("RESOURCE_EXHAUSTED", "draft service holds the maximum number of sessions")
            seed = None if msg.params.seed is None else msg.params.seed ^ 0x5EED
            session = DraftSession(msg.session_id, SeqState(next(self._seq_ids), [], 0), make_generator(seed))
            self.sessions[msg.session_id] = session
        return session

    def _handle_propose(self, msg: _Propose) -> None:
        if len(self.scheduler.waiting) >= self.max_queue_len:
            raise EngineError("RESOURCE_EXHAUSTED", f"draft queue is full ({self.max_queue_len} waiting)")
        session = self._session_for(msg)
        if session.busy:
            raise EngineError("FAILED_PRECONDITION", f"session {msg.session_id} already has a proposal in flight")
        seq = session.seq
        base = msg.context_len - len(msg.new_token_ids)
        if base < 0 or base > seq.num_verified:
            raise EngineError("NOT_FOUND", f"draft session {msg.session_id} is out of sync: send the whole context")
        verified = seq.token_ids[:base] + list(msg.new_token_ids)
        # Keep the KV of the longest computed prefix that is still right; roll back the rest.
        seq.num_computed = min(seq.num_computed, common_prefix_len(seq.token_ids[: seq.num_computed], verified))
        seq.token_ids = verified
        seq.num_verified = len(verified)
        if seq.allocated:
            self.scheduler.commit(seq)
        num_draft = min(msg.num_draft_tokens, self.max_model_len - len(verified))
        proposal = Proposal(session, num_draft, msg.params, msg.max_q_entries, msg.done)
        if num_draft <= 0:
            msg.done.set_result(proposal)
            return
        session.busy = True
        self._enqueue(proposal)

    def _enqueue(self, proposal: Proposal) -> None:
        self.scheduler.waiting.append(ForwardRequest(proposal.session.seq, [], 1, proposal))

    def idle_seqs(self) -> Iterable[SeqState]:
        return (s.seq for s in self.sessions.values() if not s.busy)

    def finish(self, request: ForwardRequest, logits: torch.Tensor) -> None:
        """logits [1, V] for the position after the session's last token."""
        proposal: Proposal = request.payload
        seq = proposal.session.seq
        seq.num_computed = len(seq.token_ids)
        self.scheduler.commit(seq)
        token = self._sample(proposal, logits)
        seq.token_ids.append(token)
        proposal.draft_ids.append(token)
        if len(proposal.draft_ids) < proposal.num_draft_tokens:
            self._enqueue(proposal)
        else:
            proposal.session.busy = False
            proposal.done.set_result(proposal)

    def _sample(self, proposal: Proposal, logits: torch.Tensor) -> int:
        if proposal.params.is_greedy:
            return int(torch.argmax(logits[0]).item())
        q = logits_to_probs(logits, proposal.params)[0]
        ids, probs = sparsify(q, proposal.max_q_entries)
        # The verifier sees q as float32 over the wire: sample from exactly those numbers.
        probs32 = [float(x) for x in np.asarray(probs, dtype=np.float32)]
        proposal.draft_dists.append(SparseDist(tuple(ids), tuple(probs32)))
        return sample_sparse(ids, probs32, proposal.session.generator)

    def fail(self, request: ForwardRequest, exc: EngineError) -> None:
        proposal: Proposal = request.payload
        proposal.session.busy = False
        proposal.done.set_exception(exc)
        self.scheduler.waiting = [r for r in self.scheduler.waiting if r is not request]
