"""Decoding ahead, the verifier's idle work, on plain ints: which sessions decode ahead in a step, the guesses each
carries, and the counts. The engine runs the forward (verifier_service/engine.py); what a verify does with the
tokens decoded ahead is verifier_service/ahead.py; how many guesses pay is specmesh/engine/guesses.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.forward_cost import Fit
from specmesh.engine.guesses import best_num_guesses, guess
from verifier_service.session import Session


@dataclass
class AheadCounts:
    """Exported as specmesh_verifier_ahead_tokens_total{outcome=<field>}."""

    decoded: int = 0             # tokens decoded ahead
    delivered: int = 0           # of them, the ones a caller received
    interrupted: int = 0         # ahead steps that gave way to a verify
    guessed: int = 0             # prompt-lookup guesses run in ahead steps
    guess_accepted: int = 0      # of them, the ones equal to the target's tokens

    def stats(self) -> dict[str, int]:
        return {f"ahead_{name}": value for name, value in dataclasses.asdict(self).items()}


def may_decode_ahead(session: Session) -> bool:
    """Whether tokens decoded ahead leave this session's verdicts as they would be. Greedy and seeded sessions: always
    (a draft is accepted iff it equals the target's own token at its position, the argmax or the seeded draw, and an
    ahead token is that token). An unseeded sampled session: unless its last verify carried the draft model's
    drafts. Its ahead token is a fresh draw from p, and a draft meeting one is accepted iff equal to it: for a one-hot
    draft d (n-gram, cache, suffix, none) that happens with probability p(d), as under rejection sampling, and the
    token emitted is p's draw either way, so the output stays distributed exactly as p. For a model draft from q,
    rejection sampling accepts with probability sum_v min(p(v), q(v)), more than a match with an independent draw
    (sum_v p(v) q(v)): decoding ahead there would cost acceptance."""
    params = session.params
    return params.is_greedy or params.seed is not None or not session.drafting


# A session whose caller drafted with the model in one of its last this many verifies is likely drafting with it now:
# a request's model rounds alternate with n-gram rounds (one stream, 2-core Intel: of 287 model rounds, 161 came
# after a model round and 95 after an n-gram round, whose Propose took 141 ms beside an ahead step against 77 alone)
MODEL_ROUNDS_NEAR = 2


class DecodeAhead:
    def __init__(self, max_tokens: int, max_model_len: int, eos_token_ids: frozenset[int]) -> None:
        self.max_tokens = max_tokens     # past what the caller received; 0: never decode ahead
        self.threads = 0                 # torch threads of a step that only decodes ahead; 0 = as any step
        self.beside_drafts = True        # sessions drafting with the draft model decode ahead too (`sessions`)
        self.guesses = False             # steps carry prompt-lookup guesses (specmesh/engine/guesses.py)
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.counts = AheadCounts()

    def sessions(self, sessions: Iterable[Session], block_manager: BlockManager) -> list[Session]:
        """Sessions that may decode one more token ahead now (`may_decode_ahead`): idle, KV up to date, under the
        ahead limit and their token budget, last token not an end of sequence; with `beside_drafts` off, not while
        the caller is likely drafting the session's next block with the draft model (one of its last
        MODEL_ROUNDS_NEAR verifies carried the model's block).
        Never more than the free KV blocks allow without preempting anybody (a quarter of the pool stays free for
        verifies).

        Why off where the draft service shares the verifier's cores (`specmesh up` on one host): one stream of the
        real pair on 2 cores (int4, Intel with AMX), a model round of 4 drafts took 200 ms with the draft on one
        thread beside a one-thread ahead step (Propose 120-230 ms, and a Verify of 5 rows ~105 ms beside the draft
        service drafting the next block ahead); with the draft on both cores, neither service working ahead of the
        other, 141 ms (Propose 77 ms: 16 ms a draft token; Verify 62 ms). The one token an ahead step would decode
        meanwhile settles a verify only when the first draft is rejected, and slows every draft token it runs
        beside."""
        if self.max_tokens <= 0:
            return []
        bm = block_manager
        room = bm.num_free_blocks - bm.num_blocks // 4
        out: list[Session] = []
        for s in sessions:
            seq, n = s.seq, len(s.seq.token_ids)
            if room <= 0:
                break
            if not self.beside_drafts and s.verifies_since_model < MODEL_ROUNDS_NEAR:
                continue
            if (s.started and not s.busy and may_decode_ahead(s) and seq.allocated and seq.num_computed == n - 1
                    and n - s.num_delivered < self.max_tokens and n < min(s.max_len, self.max_model_len)
                    and seq.token_ids[-1] not in self.eos_token_ids):
                out.append(s)
                room -= bm.num_blocks_needed(n) - len(bm.block_table(seq.seq_id))
        return out

    def guesses_for(self, ahead: list[Session], fit: Fit, num_rows: int = 0,
                    measured: Callable[[int], float | None] | None = None) -> list[list[int]]:
        """Prompt-lookup guesses per ahead session, as many as pay at the forward's measured cost (`fit`, and
        `measured` seconds per forward size where known) beside `num_rows` rows of waiting work; only for sessions
        whose caller speculates (said so at the start, or its last verify carried drafts), never past the ahead
        limit or the session's length."""
        out: list[list[int]] = []
        num_rows += len(ahead)
        for s in ahead:
            wanted = self.guesses and (s.speculative or s.drafting)
            g = best_num_guesses(s.guess_rate.rate, fit, num_rows, self._room(s), measured) if wanted else 0
            out.append(guess(s.seq.token_ids, g, self.eos_token_ids) if g else [])
            num_rows += len(out[-1])
        return out

    def _room(self, s: Session) -> int:
        n = len(s.seq.token_ids)
        return min(self.max_tokens - (n - s.num_delivered), min(s.max_len, self.max_model_len) - n) - 1

    def decoded(self, session: Session, num_guessed: int, num_accepted: int) -> None:
        """An ahead step committed num_accepted of its num_guessed guesses and the target's next token."""
        self.counts.decoded += num_accepted + 1
        self.counts.guessed += num_guessed
        self.counts.guess_accepted += num_accepted
        session.guess_rate.observe(num_guessed, num_accepted)

    def delivered(self, session: Session, num_ahead: int) -> None:
        """Every token of the session goes to the caller now, `num_ahead` of them decoded ahead."""
        self.counts.delivered += num_ahead
        session.num_delivered = len(session.seq.token_ids)
