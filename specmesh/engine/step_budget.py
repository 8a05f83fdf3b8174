"""How much prefill a step may carry beside the work of running streams: a bound in time, on plain numbers.

The scheduler (specmesh/engine/scheduler.py) puts the work of sequences that are already decoding first in every
step (verifies, decoding ahead: "decode" items, whose uncomputed context is at most a block); prefill chunks fill
what is left, in arrival order. With `cost(n) + c * P` the engine's measured seconds of an n-token step with P
attention pairs (step_cost.py: a chunk late in a long prompt attends to more positions and costs more), a step
whose decodes are d tokens with P_d pairs may cost at most

    bound(d) = max(factor * (cost(max(d, 1)) + c * P_d), cost(d + m) + c * (P_d + P_m))

that is `factor` times the decodes alone, but always room for m = `min_prefill_tokens` prefill tokens, so a long
prompt progresses every step. P_m are their pairs at the oldest prompt's *last* position (the scheduler passes
it): that floor step comes anyway, attending to the whole prompt, and sets the streams' longest gap; every earlier
step may cost as much and carry more of the prompt. The bound applies when the step
carries decodes, and also to a step without any while a stream is between two requests (an idle sequence that holds
KV): its next verify may arrive during this step and then waits for it, so the step is sized like one that carries a
one-token decode. With nobody decoding, prefill takes the whole token budget (`max_num_batched_tokens`), as does
every step before any cost is measured.

What it buys (cost(n) = a + b n per token, factor F): a stream's step while a prompt prefills costs at most F decode
steps, and a verify that arrives during a prefill-only step waits for at most one more such step; the prompt gets
(F - 1) / F of the verifier's time while one stream decodes beside it, so its time to first token is at most about
F / (F - 1) of what it is alone (less where a forward takes a few tokens for the price of one). The default F = 2
keeps issue 27's stall goal, a stream's longest gap at most 3x its median gap, with the worst case (a verify that
just missed a step) included; F = 3 would bring a long prompt's time to first token nearer 1.5x alone but lets that
worst gap reach ~4.5x. On a simulated clock (bench/step_budget_sim.py, a 4000-token prompt beside one stream with
20 ms between rounds): issue 27's AVX-512 host, F = 2: longest gap 2.9x the median, time to first token 1.77x alone;
F = 3: 4.4x and 1.41x; token budget only: 188x and 1.00x. On the real pair (2-core Zen 4, int4, attention on both
cores, `python -m bench.stall --configs target`): F = 2: 2.6x and 1.77x; F = 2.5: 4.0x and 1.55x; F = 3: 5.0x and
1.52x (steps ~0.95x their bound at the median, a few 1.3-1.6x on a shared host). On a host where tokens are cheap
and a chunk long (1 ms a token, 1 us an attention pair), F = 2 keeps 2.9x with the pairs priced and reaches 3.6x
without. min_prefill_tokens = 4 stays inside F decode steps on the
CPUs measured alone (a token beyond the first few costs 0.18-0.45 of a one-token forward: Zen 4, Zen 3, Zen 1), so
the floor rarely decides there; beside a stream late in a 4k prompt on an AVX2 Zen 3 (two sequences, attention over
~4k positions) it does: steps of 3-4.3x a decode, bench.stall's longest gap 7x the median.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specmesh.engine.step_cost import attention_pairs

Cost = Callable[[int], float | None]     # seconds of a step of n tokens, apart from attention (None: not measured)
PairCost = Callable[[int], float]        # seconds one attention pair adds to a step of n tokens (step_cost.py)


def check_step_budget(factor: float, min_prefill_tokens: int) -> None:
    """ValueError naming the setting when the bound makes no sense."""
    if factor != 0 and factor < 1:
        raise ValueError(f"step_cost_factor={factor}: must be 0 (off: token budget only) or at least 1")
    if min_prefill_tokens < 1:
        raise ValueError(f"min_prefill_tokens={min_prefill_tokens}: must be at least 1")


@dataclass(frozen=True)
class StepBudget:
    cost: Cost | None = None       # None: token budget only (no time bound)
    factor: float = 2.0            # a step carrying decodes costs at most this times its decodes alone
    min_prefill_tokens: int = 4    # prefill tokens any step may carry beside decodes, whatever they cost
    pair_cost: PairCost | None = None   # None: attention pairs are not priced (cost(n) alone)

    def seconds(self, num_tokens: int, num_pairs: int) -> float | None:
        """Estimated seconds of a step of `num_tokens` tokens with `num_pairs` attention pairs."""
        base = self.cost(num_tokens) if self.cost is not None else None
        if base is None:
            return None
        return base + (self.pair_cost(num_tokens) * num_pairs if self.pair_cost is not None else 0.0)

    def bound(self, num_decode_tokens: int, streams_waiting: bool, num_decode_pairs: int = 0,
              prefill_pos: int = 0) -> float | None:
        """The most seconds a step with these decode tokens (and their attention pairs) may cost, the floor's
        min_prefill_tokens priced from position `prefill_pos`; None: no bound (token budget only)."""
        if self.cost is None or (num_decode_tokens == 0 and not streams_waiting):
            return None
        m = self.min_prefill_tokens
        alone = self.seconds(max(num_decode_tokens, 1), num_decode_pairs)
        with_min = self.seconds(num_decode_tokens + m, num_decode_pairs + attention_pairs(prefill_pos, m))
        if alone is None or with_min is None:
            return None
        return max(self.factor * alone, with_min)

    def room(self, num_tokens: int, bound: float | None, max_tokens: int, num_pairs: int = 0,
             start_pos: int = 0) -> int:
        """The most tokens (<= max_tokens) a step already holding `num_tokens` tokens and `num_pairs` attention pairs
        can add within `bound` seconds, the added tokens running from position `start_pos` of their sequence."""
        if bound is None or self.cost is None or max_tokens <= 0:
            return max(0, max_tokens)
        lo, hi = 0, max_tokens              # cost is non-decreasing in n: bisect for the largest n that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            cost = self.seconds(num_tokens + mid, num_pairs + attention_pairs(start_pos, mid))
            if cost is not None and cost <= bound:
                lo = mid
            else:
                hi = mid - 1
        return lo
