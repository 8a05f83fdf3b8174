"""A verifier session's state: plain ints beside its sampling state."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specmesh.engine.guesses import GuessRate
from specmesh.engine.scheduled import SeqState
from specmesh.spec.sampling import SamplingParams


@dataclass
class Session:
    session_id: str
    seq: SeqState
    params: SamplingParams
    generator: torch.Generator
    max_len: int                 # prompt + max_new_tokens: no token past it is decoded ahead
    busy: bool = False           # a request of this session is queued or running
    started: bool = False        # its first token was sampled
    num_delivered: int = 0       # token_ids[:num_delivered] were sent to the caller; the rest were decoded ahead
    verifies_since_model: int = 1 << 30   # its verifies since the last that carried the draft model's block
    speculative: bool = False    # its caller drafts for it (StartSessionRequest.speculative), in any one round or not
    guess_rate: GuessRate = field(default_factory=GuessRate)   # of its ahead steps' guesses

    @property
    def drafting(self) -> bool:
        """Its last verify carried the draft model's block (its caller is likely drafting now)."""
        return self.verifies_since_model == 0
