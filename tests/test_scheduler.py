"""Tests for specmesh.engine.scheduler on plain ints (no torch, no model): chunking, the logits-token guarantee,
queue ownership, fault isolation, preemption, deadlines (the random-operations state machine:
test_scheduler_machine.py)."""

from __future__ import annotations

import pytest

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.errors import EngineError
from specmesh.engine.scheduled import ForwardRequest, ScheduledItem, SeqState
from specmesh.engine.scheduler import Scheduler


def make_scheduler(budget: int = 16, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), budget, max_num_seqs)


def verify_request(seq: SeqState, num_drafts: int, deadline: float | None = None) -> ForwardRequest:
    """Like the verifier: run the pending token and the drafts, logits for all of them."""
    return ForwardRequest(seq, [7] * num_drafts, num_drafts + 1, deadline=deadline)


def new_seq(seq_id: int, num_tokens: int, first: int = 0) -> SeqState:
    ids = [first + i for i in range(num_tokens)]
    return SeqState(seq_id, ids, num_verified=num_tokens)


def run_forward(scheduler: Scheduler, batch: list[ScheduledItem], num_accepted: int = 0) -> None:
    """Simulate the forward: chunks advance num_computed; finals commit like the verifier (accept some drafts)."""
    for item in batch:
        seq = item.request.seq
        if not item.is_final:
            seq.num_computed += len(item.token_ids)
            continue
        drafts = item.request.extra_ids
        accepted = min(num_accepted, len(drafts))
        seq.num_computed = len(seq.token_ids) + accepted
        seq.token_ids.extend(drafts[:accepted] + [1000 + len(seq.token_ids)])
        seq.num_verified = len(seq.token_ids)
        scheduler.commit(seq)


def no_idle() -> list[SeqState]:
    return []


# --------------------------------------------------------------------------------- the logits-token guarantee
def test_chunk_stops_before_the_logits_tokens() -> None:
    """The bug of issue 12: 10 context tokens + 5 drafts over a budget of 12 used to split the drafts."""
    scheduler = make_scheduler(budget=12)
    seq = new_seq(0, 10)
    scheduler.enqueue(verify_request(seq, 5))
    batch, failed = scheduler.schedule(no_idle)
    assert not failed and len(batch) == 1
    assert not batch[0].is_final and batch[0].token_ids == list(range(9))     # the pending token stays back
    run_forward(scheduler, batch)
    batch, failed = scheduler.schedule(no_idle)
    assert not failed and batch[0].is_final
    assert batch[0].start_pos == 9 and batch[0].token_ids == [9] + [7] * 5      # pending token + all 5 drafts
    run_forward(scheduler, batch, num_accepted=2)
    assert len(scheduler) == 0 and seq.num_computed == 12 and len(seq.token_ids) == 13
    scheduler.block_manager.check_invariants()


@pytest.mark.parametrize("num_drafts", [510, 511])
def test_drafts_up_to_the_budget_run_in_one_final_item(num_drafts: int) -> None:
    scheduler = make_scheduler(budget=512, num_blocks=512)
    seq = new_seq(0, 40)
    scheduler.enqueue(verify_request(seq, num_drafts))
    finals: list[ScheduledItem] = []
    for _ in range(4):
        batch, failed = scheduler.schedule(no_idle)
        assert not failed
        finals += [item for item in batch if item.is_final]
        run_forward(scheduler, batch)
    assert len(finals) == 1 and finals[0].token_ids[-num_drafts - 1:] == [39] + [7] * num_drafts
    assert len(scheduler) == 0


def test_logits_beyond_the_budget_are_refused_at_enqueue() -> None:
    """512 drafts + the pending token can never run in a 512-token step: INVALID_ARGUMENT, nothing queued."""
    scheduler = make_scheduler(budget=512, num_blocks=512)
    with pytest.raises(EngineError) as info:
        scheduler.enqueue(verify_request(new_seq(0, 4), 512))
    assert info.value.code == "INVALID_ARGUMENT" and "max_num_batched_tokens=512" in str(info.value)
    assert len(scheduler) == 0 and scheduler.block_manager.num_used_blocks == 0


def test_a_request_whose_logits_do_not_fit_what_is_left_waits_and_others_fill_the_step() -> None:
    scheduler = make_scheduler(budget=16)
    a, b, c = new_seq(0, 10), new_seq(1, 1), new_seq(2, 1)
    for req in (verify_request(a, 0), verify_request(b, 12), verify_request(c, 2)):
        scheduler.enqueue(req)
    batch, _ = scheduler.schedule(no_idle)                 # c is a decode (first), a's prefill fills the rest; b's
    assert [(i.request.seq.seq_id, len(i.token_ids), i.is_final) for i in batch] == [(2, 3, True), (0, 10, True)]
    run_forward(scheduler, batch)                          # 13 do not fit beside the prefill's reserve of 4
    batch, _ = scheduler.schedule(no_idle)                 # b gets its turn with room for all 13 logits tokens
    assert [(i.request.seq.seq_id, len(i.token_ids), i.is_final) for i in batch] == [(1, 13, True)]


def test_prefix_cache_hit_and_preemption_keep_logits_tokens_together() -> None:
    """A recomputed sequence (its verified blocks back from the prefix cache) is still chunked before its drafts."""
    scheduler = make_scheduler(budget=8, num_blocks=64, block_size=4)
    seq = new_seq(0, 20)
    scheduler.enqueue(verify_request(seq, 0))
    for _ in range(4):
        batch, _ = scheduler.schedule(no_idle)
        run_forward(scheduler, batch)
    assert len(scheduler) == 0 and len(seq.token_ids) == 21
    scheduler.preempt(seq)
    scheduler.enqueue(verify_request(seq, 6))
    batch, _ = scheduler.schedule(no_idle)
    assert seq.num_cached_tokens == 20 and batch[0].start_pos == 20
    assert batch[0].is_final and batch[0].token_ids == [seq.token_ids[-1]] + [7] * 6
    scheduler.block_manager.check_invariants()


# --------------------------------------------------------------------------------- the queue belongs to the scheduler
def test_queue_operations() -> None:
    scheduler = make_scheduler()
    seqs = [new_seq(i, 3) for i in range(3)]
    requests = [verify_request(s, 1) for s in seqs]
    for req in requests:
        scheduler.enqueue(req)
    assert len(scheduler) == scheduler.num_waiting == 3 and list(scheduler) == requests
    assert isinstance(scheduler.waiting, tuple)            # a snapshot: the queue cannot be edited through it
    with pytest.raises(AttributeError):
        scheduler.waiting = []                             # type: ignore[misc]
    with pytest.raises(ValueError):
        scheduler.enqueue(verify_request(seqs[0], 0))      # one queued request per sequence
    assert scheduler.remove(requests[1]) and not scheduler.remove(requests[1])
    assert scheduler.cancel(seqs[0]) == [requests[0]] and scheduler.cancel(seqs[0]) == []
    batch, _ = scheduler.schedule(no_idle)
    assert [i.request for i in batch] == [requests[2]] and seqs[2].allocated
    scheduler.enqueue(verify_request(seqs[2], 2))
    assert len(scheduler.release(seqs[2])) == 1 and not seqs[2].allocated
    assert len(scheduler) == 0 and scheduler.block_manager.num_used_blocks == 0
    scheduler.enqueue(requests[0])
    assert scheduler.clear() == [requests[0]] and len(scheduler) == 0


def test_expired_requests_fail_and_the_rest_run() -> None:
    scheduler = make_scheduler()
    late, alive = new_seq(0, 3), new_seq(1, 3)
    scheduler.enqueue(verify_request(late, 0, deadline=0.0))
    scheduler.enqueue(verify_request(alive, 0))
    batch, failed = scheduler.schedule(no_idle)
    assert [(r.seq.seq_id, e.code) for r, e in failed] == [(0, "DEADLINE_EXCEEDED")]
    assert [i.request.seq.seq_id for i in batch] == [1] and len(scheduler) == 0


# --------------------------------------------------------------------------------- a fault stays inside its request
def test_a_broken_request_fails_alone() -> None:
    scheduler = make_scheduler(budget=32)
    good, broken = new_seq(0, 5), new_seq(1, 5)
    scheduler.enqueue(verify_request(broken, 0))
    scheduler.enqueue(verify_request(good, 0))
    batch, failed = scheduler.schedule(no_idle)
    run_forward(scheduler, batch)
    broken.token_ids = broken.token_ids[:2]              # a bug elsewhere: fewer tokens than its KV holds
    broken.num_verified = 2
    scheduler.enqueue(verify_request(broken, 0))
    scheduler.enqueue(verify_request(good, 3))
    batch, failed = scheduler.schedule(no_idle)
    assert [(r.seq.seq_id, e.code) for r, e in failed] == [(1, "INTERNAL")]
    assert [i.request.seq.seq_id for i in batch] == [0]
    assert not broken.allocated and len(scheduler) == 0   # its KV is freed; it would recompute if it went on
    scheduler.block_manager.check_invariants()


def test_a_sequence_larger_than_the_pool_fails_with_resource_exhausted() -> None:
    scheduler = make_scheduler(budget=8, num_blocks=4, block_size=4)
    seq = new_seq(0, 30)
    scheduler.enqueue(verify_request(seq, 0))
    codes = []
    for _ in range(5):
        batch, failed = scheduler.schedule(no_idle)
        codes += [e.code for _, e in failed]
        run_forward(scheduler, batch)
    assert codes == ["RESOURCE_EXHAUSTED"] and scheduler.block_manager.num_used_blocks == 0


# --------------------------------------------------------------------------------- preemption
def test_preemption_takes_idle_sequences_first() -> None:
    scheduler = make_scheduler(budget=64, num_blocks=6, block_size=4)
    idle, old, new = new_seq(0, 12), new_seq(1, 4, first=100), new_seq(2, 4, first=200)
    for seq in (idle, old, new):
        scheduler.enqueue(verify_request(seq, 0))
    run_forward(scheduler, scheduler.schedule(no_idle)[0])   # 3 + 1 + 1 blocks used, 1 free
    scheduler.enqueue(verify_request(old, 4))                # needs 2 more blocks
    scheduler.enqueue(verify_request(new, 0))                # needs 1 more
    batch, failed = scheduler.schedule(lambda: [idle])
    assert not failed and [i.request.seq.seq_id for i in batch] == [1, 2]
    assert not idle.allocated and new.allocated and scheduler.num_preemptions == 1
    scheduler.block_manager.check_invariants()


def test_preemption_then_takes_the_newest_waiting_never_an_older_one() -> None:
    scheduler = make_scheduler(budget=64, num_blocks=4, block_size=4)
    old, new = new_seq(0, 4), new_seq(1, 4, first=100)
    for seq in (old, new):
        scheduler.enqueue(verify_request(seq, 0))
    run_forward(scheduler, scheduler.schedule(no_idle)[0])   # 1 + 1 blocks used
    scheduler.enqueue(verify_request(old, 8))                # 4 + 9 tokens: needs 3 more blocks
    scheduler.enqueue(verify_request(new, 0))
    batch, failed = scheduler.schedule(no_idle)
    assert not failed and [i.request.seq.seq_id for i in batch] == [0] and batch[0].is_final
    assert batch[0].token_ids == [old.token_ids[-1]] + [7] * 8
    assert scheduler.num_preemptions == 1 and new.num_computed == 0 and len(scheduler) == 1
    assert scheduler.block_manager.block_table(new.seq_id) == []
    run_forward(scheduler, batch, num_accepted=8)            # old now holds 13 tokens of KV: all 4 blocks
    batch, failed = scheduler.schedule(lambda: [old])        # old is idle now: new may take its blocks
    assert not failed and [i.request.seq.seq_id for i in batch] == [1] and batch[0].token_ids == new.token_ids
    assert not old.allocated and scheduler.num_preemptions == 2
    scheduler.block_manager.check_invariants()
