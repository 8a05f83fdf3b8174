"""What the step budget does to a stream and to a long prompt, on a simulated clock (no model, no torch).

    python -m bench.step_budget_sim
    python -m bench.step_budget_sim --prompt-tokens 4000 --overhead-ms 20 --factors 0,2,3

One greedy stream sends a verify of no drafts per round; `overhead` seconds (the gateway, the draft, the network)
pass between an answer and its next verify. After 100 rounds a prompt of `prompt_tokens` arrives. The real
`Scheduler` schedules every step, a step of n tokens with P attention pairs (step_cost.attention_pairs) takes
`a + b * max(0, n - free) + c * P` seconds, and the scheduler sees the engine's measured `StepCost` of the steps so
far, as in the engine; with `--no-price-pairs` only its cost by tokens, as before the pair term (a chunk late in the
prompt then overruns the bound). Reported per factor F (0 = token budget only): the prompt's time to first token
against the prompt alone, and the stream's longest gap while the prompt prefills against its median gap before it
arrived. Cost models: issue 27's AVX-512 host (55 ms a decode step, 13.7 ms per prefill token) and an AVX2 Zen 3
core (100 ms for 1-4 tokens, 22 ms per further token), both fitted by tokens alone (c = 0); and "cheap-tokens", a
host where a token beyond the first adds 1 ms (batched prefill cheap: AMX, a GPU) and attention 1 us per pair (the
order of the 1.5B model's 172 kFLOP per pair, 4 x 128 x 12 heads x 28 layers, at such a host's rate), where a step's
chunk is long and its pairs, not its tokens, decide what it costs late in a 4k prompt.
A model of the scheduler's choices, not a measurement of the engine: the serving benchmark measures that.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.scheduled import ForwardRequest, SeqState
from specmesh.engine.scheduler import Scheduler
from specmesh.engine.step_budget import StepBudget
from specmesh.engine.step_cost import StepCost

# a (s), b (s/token), free tokens, c (s/attention pair)
COST_MODELS = {"avx512": (0.055, 0.0137, 1, 0.0), "zen3": (0.1, 0.022, 4, 0.0),
               "cheap-tokens": (0.055, 0.001, 1, 1e-6)}


@dataclass(frozen=True)
class Outcome:
    ttft_s: float                 # the prompt's time to first token
    median_gap_s: float           # the stream's median gap before the prompt arrived (0 without a stream)
    longest_gap_s: float          # its longest gap while the prompt prefilled


def simulate(cost_model: tuple[float, float, int, float], factor: float, min_prefill_tokens: int,
             prompt_tokens: int, overhead_s: float, with_stream: bool = True, budget: int = 512,
             rounds_before: int = 100, price_pairs: bool = True) -> Outcome:
    a, b, free, c = cost_model
    measured = StepCost()
    step_budget = StepBudget((lambda n: measured.seconds(n, 1)) if factor else None, factor, min_prefill_tokens,
                             (lambda n: measured.pair_seconds(1)) if price_pairs else None)
    scheduler = Scheduler(BlockManager(4 * prompt_tokens // 16 + 64, 16), budget, 64, step_budget)
    stream = SeqState(0, list(range(20)), 20)
    prompt = SeqState(1, list(range(1000, 1000 + prompt_tokens)), prompt_tokens)
    now, answers, next_verify, queued = 0.0, [], 0.0 if with_stream else None, False
    arrived: float | None = None
    while True:
        if next_verify is not None and not queued and next_verify <= now:
            scheduler.enqueue(ForwardRequest(stream, [], 1))
            queued, next_verify = True, None
        if arrived is None and (len(answers) >= rounds_before or not with_stream):
            arrived = now
            scheduler.enqueue(ForwardRequest(prompt, [], 1))
        if not len(scheduler):
            now = max(now, next_verify if next_verify is not None else now)
            continue
        idle = [stream] if with_stream and not queued and stream.allocated else []
        batch, _ = scheduler.schedule(lambda idle=idle: idle)
        num_tokens = sum(len(item.token_ids) for item in batch)
        num_pairs = sum(item.num_pairs for item in batch)
        seconds = a + b * max(0, num_tokens - free) + c * num_pairs
        now += seconds
        measured.observe(num_tokens, 1, seconds, num_pairs if price_pairs else 0)
        for item in batch:
            seq = item.request.seq
            if not item.is_final:
                seq.num_computed += len(item.token_ids)
                continue
            seq.num_computed = len(seq.token_ids)
            seq.token_ids.append(7)
            seq.num_verified = len(seq.token_ids)
            scheduler.commit(seq)
            if seq is stream:
                answers.append(now)
                queued, next_verify = False, now + overhead_s
            else:
                return _outcome(now - arrived, arrived, now, answers)


def _outcome(ttft: float, arrived: float, done: float, answers: list[float]) -> Outcome:
    gaps = list(zip(answers, answers[1:], strict=False))
    before = [y - x for x, y in gaps if y < arrived]
    during = [y - x for x, y in gaps if arrived <= y] + ([done - answers[-1]] if answers else [])
    return Outcome(ttft, statistics.median(before) if before else 0.0, max(during) if answers else 0.0)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--overhead-ms", type=float, default=20.0)
    p.add_argument("--factors", default="0,2,2.5,3")
    p.add_argument("--min-prefill-tokens", type=int, default=StepBudget.min_prefill_tokens)
    p.add_argument("--no-price-pairs", dest="price_pairs", action="store_false",
                   help="the scheduler prices tokens only, not attention pairs (the engine before the pair term)")
    args = p.parse_args(argv)
    for name, model in COST_MODELS.items():
        alone = simulate(model, 0, args.min_prefill_tokens, args.prompt_tokens, 0, with_stream=False).ttft_s
        for factor in (float(f) for f in args.factors.split(",")):
            out = simulate(model, factor, args.min_prefill_tokens, args.prompt_tokens, args.overhead_ms / 1000,
                           price_pairs=args.price_pairs)
            print(f"{name:7s} F={factor:<4g} TTFT {out.ttft_s:6.1f} s = {out.ttft_s / alone:4.2f}x alone "
                  f"({alone:.1f} s); stream median gap {out.median_gap_s * 1000:4.0f} ms, longest while "
                  f"prefilling {out.longest_gap_s * 1000:6.0f} ms = {out.longest_gap_s / out.median_gap_s:6.2f}x")


if __name__ == "__main__":
    main()
