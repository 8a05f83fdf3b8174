"""What a verify's answer says about the forward that ran it: every session's share of the forward's rows and of
the tokens it emitted, so that each caller learns what the *other* sessions brought (VerifyResponse.num_other_rows,
.num_other_tokens; the gateway prices its drafts by the verifier time they take from them, gateway/verify_cost.py).

The engine notes each scheduled item's rows (`ran`) and each finished request's emitted tokens; answers are held
(`hold`) until the step's last request finished, then sent with the step's totals (`release`). Plain ints, engine
thread only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from specmesh.engine.forward_cost import UNKNOWN as UNKNOWN_COST
from specmesh.engine.forward_cost import Fit


@dataclass(frozen=True)
class VerifyResult:
    token_ids: list[int]         # accepted drafts + one target token
    num_accepted: int
    accepted_node_indices: tuple[int, ...] = ()   # the accepted drafts' indices in the request (chain: 0 .. n-1)
    num_cached_prompt_tokens: int = 0
    num_batch_tokens: int = 0    # tokens in the forward that verified this block, all sessions together
    num_waiting: int = 0         # work items queued when it finished
    cost: Fit = UNKNOWN_COST     # the measured cost of one more token beyond the free ones (forward_cost.py)
    num_other_rows: int = 0      # rows of the forward that other sessions brought
    num_other_tokens: int = 0    # tokens the forward emitted for those sessions


class Answer(Protocol):
    def set_result(self, value: VerifyResult) -> None: ...


class ForwardShare:
    def __init__(self) -> None:
        self._rows: dict[int, int] = {}            # id(request) -> its rows in the current step
        self._emitted = 0                          # tokens the step emitted so far (every request)
        self._held: list[tuple[Answer, VerifyResult, int, int]] = []   # answer, its rows, its emitted tokens

    def ran(self, request: object, num_rows: int) -> None:
        """A request's item in the step being prepared has `num_rows` rows (its chunk, or all its tokens)."""
        self._rows[id(request)] = num_rows

    def emitted(self, num_tokens: int) -> None:
        """A finished request nobody waits for (decoding ahead) emitted `num_tokens`."""
        self._emitted += num_tokens

    def hold(self, request: object, done: Answer, result: VerifyResult, num_emitted: int) -> None:
        """A finished request's answer, sent at `release`; `num_emitted` tokens of it came from this step (the rest
        were decoded ahead in earlier ones)."""
        self._emitted += num_emitted
        self._held.append((done, result, self._rows.get(id(request), 0), num_emitted))

    def release(self, num_rows: int) -> None:
        """Sends the held answers with the step's totals (`num_rows` rows in all), and starts the next step."""
        held, emitted = self._held, self._emitted
        self._rows, self._emitted, self._held = {}, 0, []
        for done, result, rows, own in held:
            done.set_result(dataclasses.replace(result, num_other_rows=max(0, num_rows - rows),
                                                num_other_tokens=max(0, emitted - own)))
