"""The draft engine: proposes k tokens per session from the small model, batched across sessions.

Each session keeps the verified context it was sent plus the tokens it drafted beyond it (its "tail"). A new
Propose call carries the newly verified tokens; the session keeps the KV of its longest prefix that still matches
the verified context (accepted drafts keep their KV), drops the rest, and drafts from there, one batched forward per
draft position.

A Propose for a session whose previous Propose is still drafting supersedes it (that caller gets ABORTED): the
gateway sends a prefetch for the next block while the verifier works and moves on when its guess fails.

Draft-ahead: after answering with k tokens the session keeps drafting `lookahead` more in the background, assuming
all k are accepted and the target's extra token equals the draft's own next guess. If the next verified context is
a prefix of the tail, the already-drafted tokens are served without waiting for the model; otherwise they are
discarded (stale). Tail tokens carry the q they were sampled from, so sampled drafts stay exact.

Guesses (greedy sessions, `guesses`): a draft forward also runs prompt-lookup guesses of the next tokens in its free
rows (specmesh/engine/guesses.py, priced by the draft's own forward cost); every guess equal to the draft's argmax is a
draft token without a forward of its own, so on repetitive text one forward drafts several tokens.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from draft_service.session_sync import place_delta, plan_sync
from specmesh.engine.batched import BatchedEngine
from specmesh.engine.batched_rejection import greedy_accept
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.guesses import GuessRate, best_num_guesses, guess
from specmesh.engine.loop import Completion, EngineError
from specmesh.engine.model_runner import ModelRunner
from specmesh.engine.scheduled import ForwardRequest, SeqState
from specmesh.spec.logit_transforms import adjust_chain
from specmesh.spec.rejection import SparseDist
from specmesh.spec.sampling import SamplingParams, logits_to_probs, make_generator, sample_sparse, sparsify
from specmesh.spec.seeded import seeded_sparse
from specmesh.telemetry.metrics import StatsCollector

log = logging.getLogger(__name__)


@dataclass
class DraftSession:
    session_id: str
    seq: SeqState                  # token_ids = caller's context + drafted tail; seq.num_verified = really verified
    base_seed: int                 # the draft's randomness at position i comes from (base_seed, i) alone
    context_len: int = 0           # the caller's context (verified + assumed tokens); the tail starts here
    busy: bool = False             # a caller waits for this session's drafts
    tail_dists: list[SparseDist | None] = field(default_factory=list)   # q of each tail token (None: greedy)
    tail_alts: list[Alternatives] = field(default_factory=list)          # tree siblings of each tail token
    ahead: DraftRequest | None = None                                    # background drafting in the queue
    guess_rate: GuessRate = field(default_factory=GuessRate)             # of its forwards' prompt-lookup guesses


@dataclass(frozen=True)
class Alternatives:
    """Siblings of a draft token in a token tree: the draft's next most likely tokens (one-hot candidates)."""
    token_ids: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()


NO_ALTERNATIVES = Alternatives()


@dataclass(frozen=True)
class Drafts:
    draft_ids: list[int]
    draft_dists: list[SparseDist]  # empty for greedy drafts
    alternatives: dict[int, Alternatives] = field(default_factory=dict)   # by draft position (tree_width > 0)


@dataclass
class Proposal:
    session: DraftSession
    num_draft_tokens: int          # answer the caller once this many tail tokens exist
    num_total_tokens: int          # keep drafting (in the background) up to this many
    params: SamplingParams
    max_q_entries: int
    done: Completion[Drafts]
    answered: bool = False
    tree_width: int = 0
    tree_confidence: float = 0.0


@dataclass(kw_only=True)
class DraftRequest(ForwardRequest):
    """One draft forward of a proposal (the next token, after any guesses)."""

    proposal: Proposal


@dataclass(frozen=True)
class _Propose:
    session_id: str
    context_len: int
    new_token_ids: list[int]
    num_draft_tokens: int
    params: SamplingParams
    max_q_entries: int
    done: Completion[Drafts]
    num_ahead_tokens: int = 0
    num_assumed_tokens: int = 0    # the context's last tokens are a guess (prefetch): never hashed as verified
    tree_width: int = 0            # alternatives per low-confidence position
    tree_confidence: float = 0.0   # top-1 draft probability below which a position gets alternatives


@dataclass(frozen=True)
class _End:
    session_id: str


DEFAULT_TREE_CONFIDENCE = 0.8


def pick_alternatives(logits: torch.Tensor, proposal: Proposal, chosen: int) -> Alternatives:
    """Up to tree_width of the draft's most likely tokens other than `chosen`, where the draft's top-1 probability
    (of the request's distribution: temperature 1 for greedy) is below the confidence threshold."""
    width = proposal.tree_width
    if width <= 0:
        return NO_ALTERNATIVES
    params = proposal.params
    probs = torch.softmax(logits.float(), dim=-1) if params.is_greedy else logits_to_probs(logits[None], params)[0]
    top_p, top_i = torch.topk(probs, min(width + 1, probs.shape[-1]))
    if float(top_p[0]) >= (proposal.tree_confidence or DEFAULT_TREE_CONFIDENCE):
        return NO_ALTERNATIVES
    pairs = [(int(i), float(p)) for i, p in zip(top_i.tolist(), top_p.tolist(), strict=True)
             if int(i) != chosen and p > 0][:width]
    return Alternatives(tuple(i for i, _ in pairs), tuple(p for _, p in pairs))


def position_seed(base_seed: int, position: int) -> int:
    """A 63-bit seed mixed from a session seed and a token position (splitmix64 finalizer)."""
    z = (base_seed + (position + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


class DraftEngine(BatchedEngine[DraftRequest]):
    trace_steps = False     # k one-token forwards per proposal: the Propose span covers them (metrics still kept)

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, max_model_len: int,
                 max_num_batched_tokens: int, max_num_seqs: int, max_queue_len: int, num_threads: int,
                 draft_ahead: bool = True, guesses: bool = False, max_catch_up_tokens: int = 0) -> None:
        super().__init__("draft-engine", runner, block_manager, max_num_batched_tokens, max_num_seqs, num_threads,
                         max_decode_tokens=max_catch_up_tokens)
        self.draft_ahead = draft_ahead
        self.guesses = guesses         # greedy draft forwards carry prompt-lookup guesses (specmesh/engine/guesses.py)
        self.num_guessed = 0           # guesses run in draft forwards
        self.num_guesses_accepted = 0  # of them, the ones equal to the draft's argmax (drafts without a forward)
        # exported as specmesh_draft_guessed_total / specmesh_draft_guess_accepted_total
        self.metrics.registry.register(StatsCollector({"draft": lambda: {
            "guessed": self.num_guessed, "guess_accepted": self.num_guesses_accepted}}))
        self.num_ahead_hits = 0        # proposals answered (partly) from drafted-ahead tokens
        self.num_resets = 0            # sessions started over because a call rewrote verified tokens
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.max_num_sessions = max_num_seqs * 4
        self.sessions: dict[str, DraftSession] = {}
        self._seq_ids = itertools.count()

    # ---- called from the event loop ---------------------------------------------------------------------------
    def propose(self, session_id: str, context_len: int, new_token_ids: list[int], num_draft_tokens: int,
                params: SamplingParams, max_q_entries: int, num_ahead_tokens: int = 0,
                num_assumed_tokens: int = 0, tree_width: int = 0, tree_confidence: float = 0.0) -> Completion[Drafts]:
        """num_ahead_tokens: tokens to draft in the background after answering (0 = k + 1 if draft-ahead is on).
        num_assumed_tokens: the context's last tokens are not verified yet (a prefetch assumes them accepted)."""
        done: Completion[Drafts] = Completion()
        self.post(_Propose(session_id, context_len, new_token_ids, num_draft_tokens, params, max_q_entries, done,
                           num_ahead_tokens, num_assumed_tokens, tree_width, tree_confidence))
        return done

    def end_session(self, session_id: str) -> None:
        self.post(_End(session_id))

    # ---- engine thread ----------------------------------------------------------------------------------------
    def handle(self, message: _Propose | _End) -> None:
        if isinstance(message, _End):
            session = self.sessions.pop(message.session_id, None)
            if session is not None:
                for req in self.scheduler.release(session.seq):
                    if not req.proposal.answered:
                        req.proposal.done.set_exception(EngineError("CANCELLED", "session ended"))
            return
        try:
            self._handle_propose(message)
        except Exception as exc:       # one message's fault answers that caller only
            if not isinstance(exc, EngineError):
                log.exception("draft: handling a Propose failed")
                exc = EngineError("INTERNAL", f"draft: {exc!r}")
            message.done.set_exception(exc)

    def _session_for(self, msg: _Propose) -> DraftSession:
        session = self.sessions.get(msg.session_id)
        if session is None:
            place_delta(False, 0, msg.context_len, len(msg.new_token_ids))
            if len(self.sessions) >= self.max_num_sessions:
                raise EngineError("RESOURCE_EXHAUSTED", "draft service holds the maximum number of sessions")
            seed = random.getrandbits(63) if msg.params.seed is None else msg.params.seed ^ 0x5EED
            session = DraftSession(msg.session_id, SeqState(next(self._seq_ids), [], 0), seed)
            self.sessions[msg.session_id] = session
        return session

    def _handle_propose(self, msg: _Propose) -> None:
        if self.scheduler.num_waiting >= self.max_queue_len:
            raise EngineError("RESOURCE_EXHAUSTED", f"draft queue is full ({self.max_queue_len} waiting)")
        session = self._session_for(msg)
        if session.busy:
            self._supersede(session)
        self._stop_ahead(session)
        base = place_delta(True, session.context_len, msg.context_len, len(msg.new_token_ids))
        context = session.seq.token_ids[:base] + list(msg.new_token_ids)
        self._sync(session, context, msg.num_assumed_tokens)
        room = self.max_model_len - len(context)
        num_draft = min(msg.num_draft_tokens, room)
        lookahead = 0
        if self.draft_ahead:
            lookahead = msg.num_ahead_tokens or (num_draft + 1 if num_draft > 0 else 0)
        proposal = Proposal(session, num_draft, min(num_draft + lookahead, room), msg.params, msg.max_q_entries,
                            msg.done, tree_width=msg.tree_width, tree_confidence=msg.tree_confidence)
        self._answer_if_ready(proposal)
        if len(session.tail_dists) < proposal.num_total_tokens:
            session.busy = not proposal.answered
            self._enqueue(proposal)

    def _supersede(self, session: DraftSession) -> None:
        """A newer Propose replaces one still waiting for its drafts (the gateway dropped a prefetch whose guess
        failed): the older caller gets ABORTED and its queued drafting stops; tokens it drafted stay in the tail
        and are kept if the new context continues them."""
        for request in self.scheduler.cancel(session.seq):
            if not request.proposal.answered:
                request.proposal.done.set_exception(EngineError("ABORTED", "superseded by a newer Propose"))
        session.busy = False
        session.ahead = None

    def _sync(self, session: DraftSession, context: list[int], num_assumed: int) -> None:
        """Make `context` the session's context (its last `num_assumed` tokens assumed, the rest verified); keep the
        tail (and KV) that still continues it. What to keep is decided in session_sync.plan_sync."""
        seq = session.seq
        plan = plan_sync(seq.token_ids, seq.num_verified, session.context_len, context, num_assumed)
        if plan.reset:
            self.num_resets += 1
            self.scheduler.release(seq)
            seq.token_ids, seq.num_computed, seq.num_verified = list(context), 0, 0
            session.tail_dists, session.tail_alts = [], []
        elif plan.tail_kept_from is not None:
            session.tail_dists = session.tail_dists[plan.tail_kept_from:]
            session.tail_alts = session.tail_alts[plan.tail_kept_from:]
            if session.tail_dists:
                self.num_ahead_hits += 1
        else:                                        # stale tail: roll back to the context
            seq.num_computed = min(seq.num_computed, plan.num_computed_cap)
            seq.token_ids = list(context)
            session.tail_dists, session.tail_alts = [], []
            if seq.allocated and seq.num_computed < self.block_manager.num_hashed_tokens(seq.seq_id):
                self.scheduler.reset(seq)            # below a hashed block: recompute (the prefix cache gives it back)
        session.context_len = len(context)
        seq.num_verified = plan.num_verified
        if seq.allocated:
            self.scheduler.commit(seq)

    def _answer_if_ready(self, proposal: Proposal) -> None:
        session = proposal.session
        if proposal.answered or len(session.tail_dists) < proposal.num_draft_tokens:
            return
        k = proposal.num_draft_tokens
        tail = session.seq.token_ids[session.context_len:][:k]
        dists = [d for d in session.tail_dists[:k] if d is not None]
        width = proposal.tree_width
        alts = {i: Alternatives(a.token_ids[:width], a.probs[:width])
                for i, a in enumerate(session.tail_alts[:k]) if width > 0 and a.token_ids}
        proposal.done.set_result(Drafts(list(tail), dists, alts))
        proposal.answered = True
        session.busy = False

    def _stop_ahead(self, session: DraftSession) -> None:
        if session.ahead is not None:
            self.scheduler.remove(session.ahead)
            session.ahead = None

    def _enqueue(self, proposal: Proposal) -> None:
        guesses = self._guesses(proposal)
        request = DraftRequest(proposal.session.seq, guesses, len(guesses) + 1, proposal=proposal)
        self.scheduler.enqueue(request)
        proposal.session.ahead = request if proposal.answered else None

    def _guesses(self, proposal: Proposal) -> list[int]:
        """Guesses of the tokens after the session's last one (greedy only: a sampled draft token must be drawn
        from its q), as many as pay at the draft's measured forward cost, within the tokens still to draft."""
        session = proposal.session
        room = proposal.num_total_tokens - len(session.tail_dists) - 1
        if not self.guesses or not proposal.params.is_greedy or room <= 0:
            return []
        threads = self.threads_for(1)
        g = best_num_guesses(session.guess_rate.rate, self.forward_cost.fit(threads), 1, room,
                             lambda n: self.forward_cost.seconds(threads, n))
        return guess(session.seq.token_ids, g, ()) if g else []

    def idle_seqs(self) -> Iterable[SeqState]:
        return (s.seq for s in self.sessions.values() if not s.busy)

    def submitted_at(self, request: DraftRequest) -> float | None:
        proposal = request.proposal
        return None if proposal.answered else proposal.done.submitted_at

    def finish(self, request: DraftRequest, logits: torch.Tensor) -> None:
        """logits [1 + g, V] for the position after the session's last token and after each of its g guesses."""
        proposal = request.proposal
        session = proposal.session
        session.ahead = None
        seq = session.seq
        params = proposal.params
        # The same transforms as the verifier's on p (row i follows the tokens so far + guesses[:i]).
        logits = adjust_chain(logits, params, seq.token_ids, request.extra_ids)
        if request.extra_ids:                 # greedy: the guesses equal to the argmax, then the argmax after them
            plain = not params.needs_context and not params.logit_bias
            rows = self.argmax_rows(request) if plain else torch.argmax(logits, dim=-1).tolist()
            tokens = greedy_accept(rows, request.extra_ids)
            dists: list[SparseDist | None] = [None] * len(tokens)
            self.num_guessed += len(request.extra_ids)
            self.num_guesses_accepted += len(tokens) - 1
        else:
            token, dist = self._sample(proposal, logits)
            tokens, dists = [token], [dist]
        session.guess_rate.observe(len(request.extra_ids), len(tokens) - 1)
        seq.num_computed = len(seq.token_ids) + len(tokens) - 1      # the pending token and the accepted guesses
        seq.token_ids.extend(tokens)
        self.scheduler.commit(seq)
        session.tail_dists.extend(dists)
        session.tail_alts.extend(pick_alternatives(logits[i], proposal, t) for i, t in enumerate(tokens))
        self._answer_if_ready(proposal)
        if len(session.tail_dists) < proposal.num_total_tokens:
            self._enqueue(proposal)

    def _sample(self, proposal: Proposal, logits: torch.Tensor) -> tuple[int, SparseDist | None]:
        if proposal.params.is_greedy:
            return int(torch.argmax(logits[0]).item()), None
        q = logits_to_probs(logits, proposal.params)[0]
        ids, probs = sparsify(q, proposal.max_q_entries)
        # The verifier sees q as float32 over the wire: sample from exactly those numbers.
        probs32 = [float(x) for x in np.asarray(probs, dtype=np.float32)]
        position = len(proposal.session.seq.token_ids)
        if proposal.params.seed is not None:   # seeded (params.is_seeded: greedy returned above)
            # The noise the verifier draws the target's token at this position with (specmesh/spec/seeded.py): a q
            # close to p mostly proposes the very token the target draws. Drawn from the q sent, so a verifier
            # that runs rejection sampling instead stays exact too.
            token = seeded_sparse(ids, probs32, proposal.params.seed, position)
            return token, SparseDist(tuple(ids), tuple(probs32))
        # One uniform per absolute position, keyed by (session seed, position): how far draft-ahead got before a
        # call arrived cannot change later samples. A position drafted again after a rejection earlier in its block
        # reuses its uniform; that is still exact, because whether a block is cut before position i never depends
        # on the token drafted at i.
        generator = make_generator(position_seed(proposal.session.base_seed, position))
        return sample_sparse(ids, probs32, generator), SparseDist(tuple(ids), tuple(probs32))

    def fail(self, request: DraftRequest, exc: EngineError) -> None:
        proposal = request.proposal
        if proposal.session.ahead is request:
            proposal.session.ahead = None
        if not proposal.answered:
            proposal.session.busy = False
            proposal.done.set_exception(exc)
        self.scheduler.remove(request)
