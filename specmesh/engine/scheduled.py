"""What the scheduler (scheduler.py) works on and hands out, on plain ints: a sequence's KV state, a request for a
forward, an item scheduled in a step, the step's stats, and the counts a batch gives its span and metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from specmesh.engine.step_cost import attention_pairs


@dataclass
class SeqState:
    seq_id: int
    token_ids: list[int]          # context tokens (verified ones first)
    num_verified: int             # token_ids[:num_verified] are verified (hashable into the prefix cache)
    num_computed: int = 0         # tokens of token_ids whose KV is in the cache
    allocated: bool = False
    num_cached_tokens: int = 0    # tokens served from the prefix cache at the last allocation


@dataclass
class ForwardRequest:
    """An engine's requests subclass it with what they carry (the caller's completion, sampling state, ...)."""

    seq: SeqState
    extra_ids: list[int]          # tokens after token_ids to run in the same forward (not part of the context)
    num_logits: int               # logits wanted for the last num_logits tokens; len(extra_ids) < num_logits
    deadline: float | None = None # time.monotonic() after which the caller no longer waits
    chunked: bool = False         # a prefill chunk of it ran: it stays prefill to its end (set by the scheduler)


R = TypeVar("R", bound=ForwardRequest)     # an engine's request type


@dataclass(frozen=True)
class ScheduledItem(Generic[R]):
    request: R
    start_pos: int                # first position run
    token_ids: list[int]          # tokens run this step
    is_final: bool                # logits are produced (otherwise a prefill chunk of context tokens only)
    is_decode: bool = False       # work of a sequence already decoding (see Scheduler.is_decode), else prefill

    @property
    def num_pairs(self) -> int:
        """Query-key pairs its attention computes (what makes a chunk late in a long prompt cost more)."""
        return attention_pairs(self.start_pos, len(self.token_ids))


@dataclass(frozen=True)
class StepStats:
    """What the last `schedule` put in the step (metrics, step spans, tests)."""
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    bound_s: float | None = None  # the step's time bound (None: token budget only)
    blocked: bool = False         # a request found no KV room: newer ones waited behind it
    in_arrival_order: bool = False  # oldest first: the oldest prefill found no KV room last step, or one slot
    estimated_s: float | None = None  # what the step budget's cost model expected the step to take (bounded steps)


def num_context_tokens(item: ScheduledItem[Any]) -> int:
    """Tokens of the item that are already in its sequence (more than 1: it computes a prompt's or context's KV;
    the rest of the item, if any, are drafts)."""
    return min(len(item.token_ids), len(item.request.seq.token_ids) - item.start_pos)


def batch_composition(batch: Sequence[ScheduledItem[Any]]) -> tuple[int, int, int]:
    """(sequences, decode tokens, prefill tokens) of a forward: decode tokens are work of sequences already decoding,
    prefill tokens prompt or recomputed context chunks. Plain counts for the forward's span and metrics
    (specmesh/telemetry/engine_step.py)."""
    decode = sum(len(i.token_ids) for i in batch if i.is_decode)
    prefill = sum(len(i.token_ids) for i in batch if not i.is_decode)
    return len(batch), decode, prefill
