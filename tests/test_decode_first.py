"""Steps that protect running streams, on plain ints (no torch): decodes before prefill, prefill chunks sized by a
cost function of the step's tokens (StepBudget), progress for long prompts, KV granted by age; and the prefill-wait
clock the engine feeds. The measured step-cost model itself: tests/test_step_cost.py."""

from __future__ import annotations

import pytest

from specmesh.config import EngineConfig
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.prefill_wait import PrefillClock
from specmesh.engine.scheduled import ForwardRequest, ScheduledItem, SeqState
from specmesh.engine.scheduler import Scheduler
from specmesh.engine.step_budget import StepBudget, check_step_budget
from specmesh.engine.step_cost import attention_pairs
from tests.test_scheduler import new_seq, no_idle, run_forward, verify_request


def linear_cost(n: int) -> float:
    """100 ms for a forward, 10 ms more per token."""
    return 0.1 + 0.01 * n


def make(budget: int = 64, num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 8,
         step_budget: StepBudget | None = None) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), budget, max_num_seqs, step_budget or StepBudget())


def decoding(scheduler: Scheduler, seq_id: int, num_tokens: int = 6) -> SeqState:
    """A sequence whose prompt has run: its KV holds all but the pending token."""
    seq = new_seq(seq_id, num_tokens, first=100 * seq_id)
    scheduler.enqueue(verify_request(seq, 0))
    while len(scheduler):
        run_forward(scheduler, scheduler.schedule(no_idle)[0])
    assert seq.allocated and seq.num_computed == len(seq.token_ids) - 1
    return seq


def kinds(batch: list[ScheduledItem]) -> list[tuple[int, bool, int, bool]]:
    return [(i.request.seq.seq_id, i.is_decode, len(i.token_ids), i.is_final) for i in batch]


@pytest.mark.parametrize("cost", [None, linear_cost])
def test_a_decode_runs_in_every_step_while_a_long_prompt_prefills(cost) -> None:
    """A decoding stream verifying 3 drafts a step and a 200-token prompt (with 5 drafts of its own: a sequence
    recomputed after a preemption) queued together: the stream is in every step, the prompt progresses in every
    step, and its final item runs all 6 of its logits tokens together."""
    scheduler = make(budget=32, step_budget=StepBudget(cost, factor=2.0, min_prefill_tokens=4))
    stream = decoding(scheduler, 0)
    prompt = new_seq(1, 200, first=1000)
    scheduler.enqueue(verify_request(prompt, 5))
    scheduler.enqueue(verify_request(stream, 3))
    prefilled, steps = 0, 0
    while prompt.num_computed < 200:
        batch, failed = scheduler.schedule(no_idle)
        assert not failed
        by_seq = {i.request.seq.seq_id: i for i in batch}
        assert by_seq[0].is_decode and by_seq[0].is_final                               # the stream, every step
        step = by_seq[1]                                                                # the prompt progresses
        assert len(step.token_ids) > 0 and step.is_decode == (200 - prompt.num_computed <= 1)   # logits only: decode
        if not step.is_decode:
            assert batch[0] is by_seq[0]                                                # decodes come first
        if cost is not None:                     # 2x the decodes alone (4 tokens: 0.28 s), 4 prefill tokens at least
            decode = scheduler.last_step.num_decode_tokens
            bound = max(2 * linear_cost(decode), linear_cost(decode + 4))
            assert scheduler.last_step.bound_s == pytest.approx(bound)
            assert linear_cost(sum(len(i.token_ids) for i in batch)) <= bound + 1e-9
        if step.is_final:
            assert step.token_ids[-6:] == [1199] + [7] * 5                             # logits tokens whole
        prefilled += len(step.token_ids)
        run_forward(scheduler, batch, num_accepted=1)
        scheduler.enqueue(verify_request(stream, 3))
        steps += 1
        assert steps < 200
    assert prefilled == 200 + 5 and len(scheduler) == 1
    assert step.is_final       # its last block ran as prefill too, within the bound (a decode only if logits alone)
    assert scheduler.last_step.num_decode_tokens + scheduler.last_step.num_prefill_tokens == 4 + len(step.token_ids)
    scheduler.block_manager.check_invariants()


def test_without_a_cost_prefill_takes_the_rest_of_the_token_budget() -> None:
    scheduler = make(budget=32)
    stream = decoding(scheduler, 0)
    scheduler.enqueue(verify_request(new_seq(1, 200, first=1000), 0))
    scheduler.enqueue(verify_request(stream, 3))
    batch, _ = scheduler.schedule(no_idle)
    assert kinds(batch) == [(0, True, 4, True), (1, False, 28, False)]
    assert scheduler.last_step.bound_s is None


def test_the_prefill_chunk_is_sized_by_time() -> None:
    """With t(n) = 0.1 + 0.01 n and factor 2 a 1-token decode step allows 0.22 s: 11 prefill tokens beside it."""
    scheduler = make(budget=512, step_budget=StepBudget(linear_cost, factor=2.0, min_prefill_tokens=4))
    stream = decoding(scheduler, 0)
    scheduler.enqueue(verify_request(new_seq(1, 300, first=1000), 0))
    scheduler.enqueue(verify_request(stream, 0))
    batch, _ = scheduler.schedule(no_idle)
    assert kinds(batch) == [(0, True, 1, True), (1, False, 11, False)]
    assert scheduler.last_step.bound_s == pytest.approx(0.22)


def test_min_prefill_tokens_when_the_decodes_alone_fill_the_time() -> None:
    """A step whose decodes already cost the bound still carries min_prefill_tokens of prefill."""
    steep = StepBudget(lambda n: 1.0 * n, factor=1.0, min_prefill_tokens=6)
    scheduler = make(budget=64, step_budget=steep)
    stream = decoding(scheduler, 0)
    scheduler.enqueue(verify_request(new_seq(1, 100, first=1000), 0))
    scheduler.enqueue(verify_request(stream, 2))
    batch, _ = scheduler.schedule(no_idle)
    assert kinds(batch) == [(0, True, 3, True), (1, False, 6, False)]


def test_a_prefill_only_step_is_bounded_while_a_stream_is_between_requests() -> None:
    """The stream's next verify could arrive during this step: sized like a step with a one-token decode. With no
    stream at all, the prompt takes the whole token budget."""
    budget = StepBudget(linear_cost, factor=2.0, min_prefill_tokens=4)
    scheduler = make(budget=128, step_budget=budget)
    stream = decoding(scheduler, 0)
    prompt = new_seq(1, 300, first=1000)
    scheduler.enqueue(verify_request(prompt, 0))
    batch, _ = scheduler.schedule(lambda: [stream])
    assert kinds(batch) == [(1, False, 12, False)]              # 0.1 + 0.01 * 12 <= 0.22
    run_forward(scheduler, batch)
    batch, _ = scheduler.schedule(no_idle)
    assert kinds(batch) == [(1, False, 128, False)] and scheduler.last_step.bound_s is None


def test_unmeasured_cost_means_token_budget_only() -> None:
    scheduler = make(budget=32, step_budget=StepBudget(lambda n: None))
    stream = decoding(scheduler, 0)
    scheduler.enqueue(verify_request(new_seq(1, 200, first=1000), 0))
    scheduler.enqueue(verify_request(stream, 0))
    batch, _ = scheduler.schedule(lambda: [stream])
    assert kinds(batch) == [(0, True, 1, True), (1, False, 31, False)]


def test_decodes_leave_the_prefill_a_slot_and_wait_one_step_each() -> None:
    scheduler = make(budget=64, max_num_seqs=3)
    streams = [decoding(scheduler, i) for i in range(3)]
    prompt = new_seq(9, 100, first=1000)
    scheduler.enqueue(verify_request(prompt, 0))
    for seq in streams:
        scheduler.enqueue(verify_request(seq, 1))
    batch, _ = scheduler.schedule(no_idle)
    assert [(i.request.seq.seq_id, i.is_decode) for i in batch] == [(0, True), (1, True), (9, False)]
    run_forward(scheduler, batch)
    batch, _ = scheduler.schedule(no_idle)
    assert [(i.request.seq.seq_id, i.is_decode) for i in batch] == [(2, True), (9, False)]


def test_the_oldest_request_if_a_decode_takes_the_tokens_it_needs() -> None:
    """The prefill's reserve of min_prefill_tokens never holds back a decode that is older than every prefill; a
    newer one that does not fit beside the reserve waits."""
    scheduler = make(budget=16, step_budget=StepBudget(None, min_prefill_tokens=8))
    old, new = decoding(scheduler, 0), decoding(scheduler, 1)
    scheduler.enqueue(verify_request(old, 12))
    scheduler.enqueue(verify_request(new_seq(5, 100, first=1000), 0))
    scheduler.enqueue(verify_request(new, 9))
    batch, _ = scheduler.schedule(no_idle)
    assert kinds(batch) == [(0, True, 13, True), (5, False, 3, False)]


def test_kv_is_granted_by_age_an_old_prefill_out_of_room_takes_it_next_step() -> None:
    """A prompt that found no KV room behind the newer decodes of this step is served first in the next one and
    preempts the newest decode for room; the decodes come back and outputs of the bookkeeping stay consistent."""
    scheduler = make(budget=16, num_blocks=8, block_size=4)
    a, b = decoding(scheduler, 0, num_tokens=12), decoding(scheduler, 1, num_tokens=12)   # 3 + 3 blocks
    prompt = new_seq(2, 12, first=1000)
    scheduler.enqueue(verify_request(prompt, 0))
    scheduler.enqueue(verify_request(a, 3))
    scheduler.enqueue(verify_request(b, 3))
    batch, _ = scheduler.schedule(no_idle)           # a and b take a block each: the prompt finds none
    assert kinds(batch) == [(0, True, 4, True), (1, True, 4, True)] and scheduler.last_step.blocked
    run_forward(scheduler, batch)
    scheduler.enqueue(verify_request(a, 0))
    scheduler.enqueue(verify_request(b, 0))
    batch, _ = scheduler.schedule(no_idle)
    assert scheduler.last_step.in_arrival_order and batch[0].request.seq is prompt
    assert scheduler.num_preemptions >= 1
    scheduler.block_manager.check_invariants()


def test_step_budget_settings_are_checked_and_match_the_config_defaults() -> None:
    assert (EngineConfig.step_cost_factor, EngineConfig.min_prefill_tokens) == (StepBudget.factor,
                                                                                StepBudget.min_prefill_tokens)
    check_step_budget(0, 1)
    with pytest.raises(ValueError, match="step_cost_factor=0.5"):
        check_step_budget(0.5, 8)
    with pytest.raises(ValueError, match="min_prefill_tokens=0"):
        check_step_budget(2.0, 0)


def test_prefill_clock_counts_only_the_overlap_with_prefill_forwards() -> None:
    clock = PrefillClock()
    clock.record(0.0, 1.0)
    clock.record(1.5, 2.0)
    clock.record(3.0, 3.0)                  # empty: not recorded
    assert clock.waited(0.5, 1.8) == pytest.approx(0.5 + 0.3)
    assert clock.waited(2.0, 3.0) == 0.0
    assert clock.waited(-1.0, 5.0) == pytest.approx(1.5)


def test_scheduled_items_are_decode_or_prefill() -> None:
    scheduler = make(budget=16)
    seq = decoding(scheduler, 0)
    request = ForwardRequest(seq, [1, 2], 3)
    scheduler.enqueue(request)
    assert scheduler.is_decode(request)
    scheduler.preempt(seq)
    assert not scheduler.is_decode(request)            # its KV is gone: recomputed as prefill unless cached


def test_the_default_budget_keeps_a_stream_within_3x_its_median_gap_on_a_simulated_clock() -> None:
    """bench/step_budget_sim.py with the defaults and issue 27's host (55 ms a decode step, 13.7 ms a prefill
    token), a 4000-token prompt beside a stream with 20 ms between rounds: the stream's longest gap while the
    prompt prefills stays within 3x its median (the token budget alone: over 100x), the prompt's time to first
    token within 2x its time alone."""
    from bench.step_budget_sim import COST_MODELS, simulate

    model, defaults = COST_MODELS["avx512"], StepBudget()
    alone = simulate(model, 0, defaults.min_prefill_tokens, 4000, 0.0, with_stream=False).ttft_s
    shared = simulate(model, defaults.factor, defaults.min_prefill_tokens, 4000, 0.02)
    assert shared.longest_gap_s <= 3 * shared.median_gap_s
    assert shared.ttft_s <= 2 * alone
    tokens_only = simulate(model, 0, defaults.min_prefill_tokens, 4000, 0.02)
    assert tokens_only.longest_gap_s > 100 * tokens_only.median_gap_s


def test_pricing_attention_pairs_keeps_the_bound_where_late_chunks_are_dear() -> None:
    """bench/step_budget_sim.py on a host where tokens are cheap (1 ms) and attention is not (1 us a pair): chunks
    are long, so late in a 4000-token prompt their pairs decide their cost. Priced, the stream keeps 3x its median
    gap; priced by tokens alone (the engine before the pair term), the late chunks overrun the bound."""
    from bench.step_budget_sim import COST_MODELS, simulate

    model, defaults = COST_MODELS["cheap-tokens"], StepBudget()
    priced = simulate(model, defaults.factor, defaults.min_prefill_tokens, 4000, 0.02)
    by_tokens = simulate(model, defaults.factor, defaults.min_prefill_tokens, 4000, 0.02, price_pairs=False)
    assert priced.longest_gap_s <= 3 * priced.median_gap_s < by_tokens.longest_gap_s


@pytest.mark.parametrize("max_decode_tokens, expect_decode", [(0, False), (32, True)])
def test_a_running_sessions_catch_up_goes_before_an_older_prompt(max_decode_tokens: int, expect_decode: bool) -> None:
    """The draft service's case: a running session's Propose brings 20 tokens verified since its last one (rounds
    the gateway drafted elsewhere) while an older 200-token prompt prefills. With one block as the decode bound it is
    prefill and waits behind the whole prompt (the 25 s stall seen on the real pair); with max_decode_tokens 32 it
    runs in the next step, whole."""
    scheduler = make(budget=32, step_budget=StepBudget(linear_cost, factor=2.0, min_prefill_tokens=4))
    scheduler.max_decode_tokens = max_decode_tokens
    stream = decoding(scheduler, 0)
    prompt = new_seq(1, 200, first=1000)
    scheduler.enqueue(verify_request(prompt, 0))
    stream.token_ids += list(range(500, 520))                   # 20 tokens verified elsewhere, then a Propose
    stream.num_verified = len(stream.token_ids)
    scheduler.enqueue(verify_request(stream, 0))
    steps = 0
    while True:
        batch, _ = scheduler.schedule(no_idle)
        steps += 1
        by_seq = {i.request.seq.seq_id: i for i in batch}
        run_forward(scheduler, batch)
        if 0 in by_seq and by_seq[0].is_final:
            break
    assert (steps == 1) == expect_decode
    assert by_seq[0].is_decode == expect_decode
    if not expect_decode:
        assert prompt.num_computed == 200                       # it waited out the prompt's whole prefill


def test_a_catch_up_split_by_a_full_step_stays_a_decode() -> None:
    """A catch-up of 40 tokens (a decode with max_decode_tokens 48) in a 32-token step runs in two parts, and the
    second still goes before the older prompt's chunks: only a prompt's chunks make a request prefill to its end."""
    scheduler = make(budget=32, step_budget=StepBudget(None, min_prefill_tokens=4))
    scheduler.max_decode_tokens = 48
    stream = decoding(scheduler, 0)
    prompt = new_seq(1, 200, first=1000)
    scheduler.enqueue(verify_request(prompt, 0))
    stream.token_ids += list(range(500, 540))
    stream.num_verified = len(stream.token_ids)
    catch_up = verify_request(stream, 0)
    scheduler.enqueue(catch_up)
    for _ in range(2):
        batch, _ = scheduler.schedule(no_idle)
        assert batch[0].request is catch_up and batch[0].is_decode
        run_forward(scheduler, batch)
    assert batch[0].is_final and not catch_up.chunked and prompt.num_computed < 200


# ------------------------------------------------------------------ attention pairs: late chunks of long prompts
def test_a_chunk_late_in_a_long_prompt_is_shorter_and_every_step_keeps_its_bound() -> None:
    """A stream decoding beside a 600-token prompt, pairs priced: each step's cost (tokens and pairs) stays within
    its bound, the prompt progresses every step, and its chunks shrink as they attend to more positions."""
    def pair_cost(num_tokens: int) -> float:
        return 1e-4

    budget = StepBudget(linear_cost, factor=2.0, min_prefill_tokens=4, pair_cost=pair_cost)
    scheduler = make(budget=128, num_blocks=512, step_budget=budget)
    stream = decoding(scheduler, 0)
    prompt = new_seq(1, 600, first=5000)
    scheduler.enqueue(verify_request(prompt, 0))
    chunks = []
    while prompt.num_computed < len(prompt.token_ids) - 1:
        scheduler.enqueue(verify_request(stream, 1))
        batch = scheduler.schedule(no_idle)[0]
        assert any(i.request.seq is stream for i in batch)
        step = budget.seconds(sum(len(i.token_ids) for i in batch), sum(i.num_pairs for i in batch))
        bound = scheduler.last_step.bound_s
        assert bound is not None and step is not None and step <= bound + 1e-12
        chunk = [i for i in batch if i.request.seq is prompt]
        assert chunk and chunk[0].token_ids
        if not chunk[0].is_final:
            chunks.append(len(chunk[0].token_ids))
        run_forward(scheduler, batch)
    assert chunks[-1] < chunks[0] / 2


@pytest.mark.parametrize("max_decode_tokens, expect_steps", [(128, 17), (512, 1)])
def test_a_long_catch_up_beside_an_idle_session_runs_whole(max_decode_tokens: int, expect_steps: int) -> None:
    """The draft service beside a long prompt whose own draft prefill is done (its session idle, waiting for the
    verifier): a suffix-drafted stream's Propose brings 200 tokens verified since its last model round. Beyond the
    decode limit it is chunked like a prompt and every chunk is sized for the idle session's next request (2x a
    one-token step): a few tokens a step, the 1.7-2.6 s draft stalls traced on the real pair at the old limit of
    128. Within the limit (the default, 512) it runs whole in the next step."""
    scheduler = make(budget=512, num_blocks=512, step_budget=StepBudget(linear_cost, factor=2.0, min_prefill_tokens=4))
    scheduler.max_decode_tokens = max_decode_tokens
    stream, idle = decoding(scheduler, 0), decoding(scheduler, 1)
    stream.token_ids += list(range(500, 700))
    stream.num_verified = len(stream.token_ids)
    catch_up = verify_request(stream, 0)
    scheduler.enqueue(catch_up)
    steps = 0
    while len(scheduler):
        batch, _ = scheduler.schedule(lambda: [idle])
        run_forward(scheduler, batch)
        steps += 1
        assert steps <= 100
    assert steps == expect_steps                 # 2 x 0.11 s fits 12 tokens a step: 200 tokens take 17 steps
    assert catch_up.chunked == (max_decode_tokens < 200)


def test_every_step_beside_a_long_prompt_may_cost_what_its_last_floor_step_will() -> None:
    """Pairs priced dear: the floor's 4 tokens at the end of a 600-token prompt cost more than 2 decodes alone. That
    step comes anyway (and sets the stream's longest gap), so the first step is bounded by it too: the early chunk,
    cheap in pairs, is longer than 2 decodes' bound would have let it be."""
    budget = StepBudget(linear_cost, factor=2.0, min_prefill_tokens=4, pair_cost=lambda num_tokens: 1e-4)
    scheduler = make(budget=128, num_blocks=512, step_budget=budget)
    stream = decoding(scheduler, 0)
    prompt = new_seq(1, 600, first=5000)
    scheduler.enqueue(verify_request(prompt, 0))
    scheduler.enqueue(verify_request(stream, 1))
    batch = scheduler.schedule(no_idle)[0]
    decode = next(i for i in batch if i.request.seq is stream)           # its pending token and 1 draft
    d, decode_pairs = len(decode.token_ids), decode.num_pairs
    last_floor = budget.seconds(d + 4, decode_pairs + attention_pairs(600 - 4, 4))
    decodes_alone = budget.bound(d, True, decode_pairs, 0)
    assert last_floor is not None and decodes_alone is not None and last_floor > decodes_alone
    assert scheduler.last_step.bound_s == pytest.approx(last_floor)
    chunk = len(next(i for i in batch if i.request.seq is prompt).token_ids)
    assert chunk > budget.room(d, decodes_alone, 128 - d, decode_pairs, 0) >= 4
