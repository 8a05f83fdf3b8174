"""A random-operations state machine over specmesh.engine.scheduler on plain ints (no torch, no model):
near-context prompts beside short verifying sequences, shared prefixes, small pools, expiries and cancels, steps
sized by random cost functions; the block manager's invariants and the decode-first properties after every step."""

from __future__ import annotations

import random

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.errors import EngineError
from specmesh.engine.scheduled import ForwardRequest, ScheduledItem, SeqState
from specmesh.engine.scheduler import Scheduler
from specmesh.engine.step_budget import StepBudget

MAX_MODEL_LEN = 48
SHARED_PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8] * 6, [9, 8, 7, 6, 5, 4, 3, 2] * 6]
MAX_DECODE_WAIT = 8      # steps a decode that fits beside the prefill's reserve may be passed over while prefill runs


def step_cost(shape: str, base_ms: int, per_token_ms: int, free: int):
    """A monotone cost of an n-token step: none (token budget only), linear, or flat up to `free` tokens."""
    if shape == "none":
        return None
    if shape == "linear":
        return lambda n: (base_ms + per_token_ms * n) / 1000
    return lambda n: (base_ms + per_token_ms * max(0, n - free)) / 1000


class SchedulerMachine(RuleBasedStateMachine):
    """Near-context prompts, short sequences verifying k in 0..16 drafts, shared prefixes, small pools, expired
    requests and cancels, steps sized by a random cost function; every step is simulated like the verifier and
    checked, including the protection of decoding sequences while prefill runs (see _check_decode_first)."""

    @initialize(budget=st.integers(8, 40), max_num_seqs=st.integers(1, 6), block_size=st.sampled_from([2, 4, 8]),
                 extra_blocks=st.integers(0, 12), prefix_caching=st.booleans(),
                 cost_shape=st.sampled_from(["none", "linear", "flat"]), base_ms=st.integers(10, 200),
                 per_token_ms=st.integers(0, 50), free=st.sampled_from([1, 2, 4, 8]),
                 factor=st.sampled_from([1.0, 1.5, 2.0, 3.0]), min_prefill=st.integers(1, 8))
    def setup(self, budget: int, max_num_seqs: int, block_size: int, extra_blocks: int, prefix_caching: bool,
              cost_shape: str, base_ms: int, per_token_ms: int, free: int, factor: float, min_prefill: int) -> None:
        num_blocks = -(-MAX_MODEL_LEN // block_size) + extra_blocks
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.cost = step_cost(cost_shape, base_ms, per_token_ms, free)
        self.step_budget = StepBudget(self.cost, factor, min_prefill)
        self.scheduler = Scheduler(self.bm, budget, max_num_seqs, self.step_budget)
        self.passed_over: dict[int, int] = {}    # id(request) -> steps it was passed over while prefill ran
        self.seqs: dict[int, SeqState] = {}
        self.queued: dict[int, ForwardRequest] = {}
        self.next_id = 0
        self.num_finals = 0

    # ---- traffic --------------------------------------------------------------------------------------------
    @rule(prefix=st.sampled_from([0, 1]), shared=st.integers(0, 48), tail=st.lists(st.integers(0, 99), max_size=12),
          near_context=st.booleans())
    def start(self, prefix: int, shared: int, tail: list[int], near_context: bool) -> None:
        if len(self.seqs) >= 8:
            return
        prompt = (SHARED_PREFIXES[prefix][:shared] + tail)[: MAX_MODEL_LEN - 1]
        if near_context:
            prompt = (SHARED_PREFIXES[prefix] + tail + [0] * MAX_MODEL_LEN)[: MAX_MODEL_LEN - 1 - len(tail) % 3]
        if not prompt:
            prompt = [prefix]
        seq = SeqState(self.next_id, prompt, num_verified=len(prompt))
        self.next_id += 1
        self.seqs[seq.seq_id] = seq
        self._enqueue(ForwardRequest(seq, [], 1))

    @rule(data=st.data(), k=st.integers(0, 16))
    def verify(self, data: st.DataObject, k: int) -> None:
        idle = [s for s in self.seqs.values() if s.seq_id not in self.queued and len(s.token_ids) < MAX_MODEL_LEN]
        if not idle:
            return
        seq = data.draw(st.sampled_from(idle))
        drafts = data.draw(st.lists(st.integers(0, 99), min_size=k, max_size=k))[: MAX_MODEL_LEN - len(seq.token_ids)]
        self._enqueue(ForwardRequest(seq, drafts, len(drafts) + 1))

    def _enqueue(self, request: ForwardRequest) -> None:
        try:
            self.scheduler.enqueue(request)
        except EngineError as exc:
            assert exc.code == "INVALID_ARGUMENT" and request.num_logits > self.scheduler.max_num_batched_tokens
            event("refused: drafts beyond the step budget")
            return
        assert request.num_logits <= self.scheduler.max_num_batched_tokens
        self.queued[request.seq.seq_id] = request

    @rule(data=st.data(), chance=st.integers(0, 3))
    def expire(self, data: st.DataObject, chance: int) -> None:
        if chance == 0 and self.queued:          # rarely, so sessions live long enough to be preempted
            data.draw(st.sampled_from(sorted(self.queued.values(), key=lambda r: r.seq.seq_id))).deadline = 0.0

    @rule(data=st.data(), chance=st.integers(0, 2))
    def cancel(self, data: st.DataObject, chance: int) -> None:
        if chance == 0 and self.seqs:
            self._end(data.draw(st.sampled_from(sorted(self.seqs.values(), key=lambda s: s.seq_id))))

    def _end(self, seq: SeqState) -> None:
        removed = self.scheduler.release(seq)
        assert removed == ([self.queued.pop(seq.seq_id)] if seq.seq_id in self.queued else [])
        del self.seqs[seq.seq_id]

    # ---- one engine step ------------------------------------------------------------------------------------
    @rule(seed=st.integers(0, 2**32), num_steps=st.integers(1, 3))
    def step(self, seed: int, num_steps: int) -> None:
        rng = random.Random(seed)
        for _ in range(num_steps):
            self._step(rng)

    def _step(self, rng: random.Random) -> None:
        had_work = len(self.scheduler) > 0
        before = {s.seq_id: s.num_computed for s in self.seqs.values()}
        num_preemptions = self.scheduler.num_preemptions
        queue = list(self.scheduler.waiting)
        batch, failed = self.scheduler.schedule(self._idle)
        preempted = self.scheduler.num_preemptions > num_preemptions
        if preempted:
            event("preemption")
        self._check_decode_first(queue, batch, failed, preempted)
        assert not had_work or batch or failed, "work waited but nothing ran or failed"
        for request, error in failed:
            assert error.code in ("DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"), error
            event(f"failed: {error.code}")
            assert request not in self.scheduler.waiting
            self.queued.pop(request.seq.seq_id)
            self._end(request.seq)                       # the verifier closes a failed session
        self._check_batch(batch, before)
        for item in batch:
            self._simulate(item, rng)
        self.bm.check_invariants()

    def _idle(self) -> list[SeqState]:
        return [s for s in self.seqs.values() if s.seq_id not in self.queued]

    def _check_batch(self, batch: list[ScheduledItem], before: dict[int, int]) -> None:
        assert sum(len(i.token_ids) for i in batch) <= self.scheduler.max_num_batched_tokens
        assert len(batch) <= self.scheduler.max_num_seqs
        assert len({i.request.seq.seq_id for i in batch}) == len(batch)
        for item in batch:
            req, seq = item.request, item.request.seq
            assert self.queued[seq.seq_id] is req
            full = seq.token_ids + req.extra_ids
            end = item.start_pos + len(item.token_ids)
            assert item.start_pos == seq.num_computed and item.token_ids == full[item.start_pos: end]
            assert self.bm.num_tokens(seq.seq_id) == end     # the slots it writes are reserved
            assert len(item.token_ids) > 0
            if item.is_final:
                assert end == len(full) and len(item.token_ids) >= req.num_logits   # every logits token runs
                assert req not in self.scheduler.waiting
            else:
                assert end <= len(full) - req.num_logits   # a chunk never reaches the logits tokens
                event("chunk")
                assert req in self.scheduler.waiting
            if item.start_pos < before.get(seq.seq_id, 0):
                assert item.start_pos == seq.num_cached_tokens   # recomputed after a preemption in this step
            if seq.num_cached_tokens:
                event("prefix cache hit")

    def _check_decode_first(self, queue: list[ForwardRequest], batch: list[ScheduledItem], failed: list,
                            preempted: bool) -> None:
        """While prefill runs, decoding sequences keep running: every step with a prefill item carries a decode
        whenever one that fits beside the prefill's token reserve waits, no such decode is passed over more than
        MAX_DECODE_WAIT steps in a row, and waiting prefill progresses every step (all unless a request found no
        KV room, which may hold the step back). A step never costs more than its time bound, and the bound never
        exceeds max(factor * t(max(d, 1)), t(d + min_prefill_tokens)) for its d decode tokens."""
        sched, stats = self.scheduler, self.scheduler.last_step
        items = {id(i.request): i for i in batch}
        gone = {id(r) for r, _ in failed}
        live = [r for r in queue if id(r) not in gone]
        is_decode = {id(r): items[id(r)].is_decode if id(r) in items else sched.is_decode(r) for r in live}
        decode_tokens = sum(len(i.token_ids) for i in batch if i.is_decode)
        assert (stats.num_decode_tokens, stats.num_prefill_tokens) == (
            decode_tokens, sum(len(i.token_ids) for i in batch) - decode_tokens)
        if stats.bound_s is not None:
            assert self.cost is not None
            assert self.cost(sum(len(i.token_ids) for i in batch)) <= stats.bound_s + 1e-9
            f, m = self.step_budget.factor, self.step_budget.min_prefill_tokens
            assert stats.bound_s <= max(f * self.cost(max(decode_tokens, 1)), self.cost(decode_tokens + m)) + 1e-9
        if stats.blocked or preempted or stats.in_arrival_order or sched.max_num_seqs == 1:
            return                                     # KV room decided this step (or one slot: no mixing)
        budget = sched.max_num_batched_tokens
        reserve = min(self.step_budget.min_prefill_tokens, budget // 2)
        prefill_ran = any(not i.is_decode for i in batch)
        fitting = [r for r in live if is_decode[id(r)] and id(r) not in items
                   and len(r.seq.token_ids) - r.seq.num_computed + len(r.extra_ids) <= budget - reserve]
        if prefill_ran and any(i.is_decode for i in batch):
            event("decode and prefill in one step")
        if prefill_ran and fitting:
            event("a decode passed over while prefill ran (no slot or tokens left)")
            assert any(i.is_decode for i in batch), "a decode waited while prefill ran"
        for req in live:
            key = id(req)
            if key in items or not is_decode[key]:
                self.passed_over.pop(key, None)
            elif prefill_ran and req in fitting:
                self.passed_over[key] = self.passed_over.get(key, 0) + 1
                assert self.passed_over[key] <= MAX_DECODE_WAIT, "a decode starved behind prefill"
        if live and any(not is_decode[id(r)] for r in live) and not is_decode[id(live[0])]:
            event("prefill progress checked")
            assert prefill_ran, "waiting prefill made no progress"

    def _simulate(self, item: ScheduledItem, rng: random.Random) -> None:
        seq, req = item.request.seq, item.request
        if not item.is_final:
            seq.num_computed += len(item.token_ids)
            return
        self.num_finals += 1
        del self.queued[seq.seq_id]
        accepted = rng.randint(0, len(req.extra_ids))
        seq.num_computed = len(seq.token_ids) + accepted
        seq.token_ids.extend(req.extra_ids[:accepted] + [rng.randrange(100)])
        seq.num_verified = len(seq.token_ids)
        self.scheduler.commit(seq)
        if len(seq.token_ids) >= MAX_MODEL_LEN:
            self._end(seq)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        assert len(self.scheduler) == len(self.queued)
        assert {r.seq.seq_id for r in self.scheduler} == set(self.queued)
        for seq in self.seqs.values():
            if seq.allocated:
                assert self.bm.num_tokens(seq.seq_id) == seq.num_computed <= len(seq.token_ids)

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        rng = random.Random(0)
        for _ in range(400):                              # everything queued finishes (or fails) in bounded steps
            if not self.scheduler:
                break
            self._step(rng)
        assert len(self.scheduler) == 0
        for seq in list(self.seqs.values()):
            self._end(seq)
        self.bm.check_invariants()
        assert self.bm.num_used_blocks == 0 and self.bm.num_free_blocks == self.bm.num_blocks


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=80, deadline=None)
