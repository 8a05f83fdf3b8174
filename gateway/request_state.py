"""One request's state in the gateway, in one owner: budget, verified output, what the client received, why it
finished, round counters; and one event.

`Generation` (gateway/round_loop.py) owns a `RequestState`, calls `on_round(event)` once per verified round and
runs until `finished`; everything that learns from rounds listens to that event instead of keeping its own copy
(adaptive draft length, the drafter's tier stats and cache write-back, hit-rate counters). The eos / max-token cut
is made here (`on_first_token`, `on_round` return what the client may receive), and a stop string the text stream
found ends the request here too (`stop_string`). Plain ints and lists: no I/O, no clock.

Because it holds everything a session needs (the prompt, every verified token, the budget left), a session can be
opened again elsewhere from it: the verifier replica that dies mid-stream is replaced by one prefilled with
`context_ids` (gateway/verifier_session.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.proposers.base import Draft
from gateway.verify_cost import UNKNOWN_COST, VerifyCost
from protos.specmesh.v1 import common_pb2

UNFINISHED = common_pb2.FINISH_REASON_UNSPECIFIED


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
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    output_ids: list[int] = field(default_factory=list)     # every verified token, not cut at eos / stop strings
    num_emitted: int = 0                                    # tokens the client receives (cut at eos / max / stop)
    finish_reason: common_pb2.FinishReason = UNFINISHED
    num_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_failovers: int = 0                                  # sessions opened again on another verifier replica
    num_cached_prompt_tokens: int = 0                       # prompt tokens the first replica had cached
    listeners: list[RoundListener] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        """Tokens the client can still receive."""
        return max(self.max_new_tokens - len(self.output_ids), 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason != UNFINISHED

    def draft_room(self, num_pending: int = 0) -> int:
        """Draft tokens worth verifying now: one verified token always comes from the target, and `num_pending`
        tokens (a block being verified, plus its target token) are ahead of this draft."""
        return max(self.remaining - 1 - num_pending, 0)

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def on_first_token(self, token_id: int) -> list[int]:
        """The prefill's token (or, after a failover, the new replica's first token): what the client receives."""
        self.output_ids.append(token_id)
        return self._cut([token_id])

    def on_failover(self, token_id: int) -> list[int]:
        """The first token of the session opened again on another replica (after every verified token)."""
        self.num_failovers += 1
        return self.on_first_token(token_id)

    def on_round(self, event: RoundEvent) -> list[int]:
        """Applies a verified round; returns its tokens the client receives (cut at eos / max_new_tokens)."""
        self.output_ids.extend(event.token_ids)
        self.num_rounds += 1
        self.num_drafted += len(event.draft.token_ids)
        self.num_accepted += event.num_accepted
        for listener in self.listeners:
            listener(event, self)
        return self._cut(event.token_ids)

    def _cut(self, token_ids: list[int]) -> list[int]:
        """The leading tokens before eos, up to the budget; sets the finish reason where it cuts."""
        kept: list[int] = []
        for token in token_ids:
            if not self.ignore_eos and token in self.eos_token_ids:
                self.finish_reason = common_pb2.FINISH_REASON_STOP
                break
            kept.append(token)
            if self.num_emitted + len(kept) >= self.max_new_tokens:
                self.finish_reason = common_pb2.FINISH_REASON_LENGTH
                break
        self.num_emitted += len(kept)
        return kept

    def stop_string(self, num_tokens_consumed: int, last_tokens: list[int]) -> list[int]:
        """A stop string completed within the first `num_tokens_consumed` tokens the client was to receive: the
        request ends there. Returns the part of `last_tokens` (the latest tokens cut) still sent."""
        before = self.num_emitted - len(last_tokens)
        self.num_emitted = num_tokens_consumed
        self.finish_reason = common_pb2.FINISH_REASON_STOP_STRING
        return last_tokens[:max(0, num_tokens_consumed - before)]

    def stop_string_held(self) -> None:
        """The stop string completed only in the text held back at the finish (no token is cut)."""
        self.finish_reason = common_pb2.FINISH_REASON_STOP_STRING
