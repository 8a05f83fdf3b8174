"""One request's state in the gateway, in one owner: budget, verified output, round counters; and one event.

`Generation` (gateway/round_loop.py) owns a `RequestState` and calls `on_round(event)` once per verified round;
everything that learns from rounds listens to that event instead of keeping its own copy (adaptive draft length,
the drafter's tier stats and cache write-back, hit-rate counters). Plain ints and lists: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.drafters import Draft
from gateway.verify_cost import UNKNOWN_COST, VerifyCost


@dataclass(frozen=True)
class RoundEvent:
    round: int                   # 1-based
    draft: Draft
    num_accepted: int
    token_ids: list[int]         # the verified tokens of this round: accepted drafts, then the target's token
    draft_s: float               # seconds the round waited for its draft
    verify_s: float              # seconds the round waited for its Verify
    num_waiting: int             # the verifier's load when it answered
    num_batch_tokens: int
    accepted_node_indices: list[int] = field(default_factory=list)   # a tree's accepted path (empty: a chain)
    cost: VerifyCost = UNKNOWN_COST   # what the verifier reported about its forward's cost


RoundListener = Callable[[RoundEvent, "RequestState"], None]


@dataclass
class RequestState:
    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)     # every verified token, not cut at eos / stop strings
    num_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    listeners: list[RoundListener] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        """Tokens the client can still receive."""
        return max(self.max_new_tokens - len(self.output_ids), 0)

    def draft_room(self, num_pending: int = 0) -> int:
        """Draft tokens worth verifying now: one verified token always comes from the target, and `num_pending`
        tokens (a block being verified, plus its target token) are ahead of this draft."""
        return max(self.remaining - 1 - num_pending, 0)

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def on_first_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)

    def on_round(self, event: RoundEvent) -> None:
        self.output_ids.extend(event.token_ids)
        self.num_rounds += 1
        self.num_drafted += len(event.draft.token_ids)
        self.num_accepted += event.num_accepted
        for listener in self.listeners:
            listener(event, self)
