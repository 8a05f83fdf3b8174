"""How each model-drafted round ended, counted gateway-wide (plain ints; Prometheus via ServiceServer.stats).

The classes are what drafting ahead has to guess (which block comes next):
    all_accepted               the whole main chain was accepted; the target then added its bonus token, which the
                               draft's own next token (the prefetch's guess) matched (`bonus_guessed`) or not
                               (`bonus_missed`); rounds with no prefetch to compare are neither
    rejected_alt_hit           the target rejected a chain token and accepted one of its tree alternatives instead
    rejected_alt_miss          rejected at a position that had alternatives, none of them the target's choice
    rejected_no_alt            rejected at a position without alternatives (every rejection of a plain chain)
    branch_continuation_ready  (overlap) the next round's drafts were prefetched after the likeliest alternative,
                               and the target took that alternative (and the branch guessed its bonus token)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.draft_tree import main_chain_len
from gateway.proposers.base import Draft


@dataclass
class RoundOutcomes:
    rounds: int = 0
    all_accepted: int = 0
    bonus_guessed: int = 0
    bonus_missed: int = 0
    rejected_alt_hit: int = 0
    rejected_alt_miss: int = 0
    rejected_no_alt: int = 0
    branch_continuation_ready: int = 0   # overlap: the round after an alternative hit was drafted while verifying

    def observe(self, draft: Draft, num_accepted: int, accepted_node_indices: Sequence[int]) -> None:
        if not draft.token_ids:
            return
        self.rounds += 1
        outcome = classify(draft, num_accepted, accepted_node_indices)
        setattr(self, outcome, getattr(self, outcome) + 1)

    def observe_bonus(self, guessed: bool) -> None:
        if guessed:
            self.bonus_guessed += 1
        else:
            self.bonus_missed += 1

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


def classify(draft: Draft, num_accepted: int, accepted_node_indices: Sequence[int]) -> str:
    """One of all_accepted, rejected_alt_hit, rejected_alt_miss, rejected_no_alt. A verifier that returns no node
    indices verified a chain: its path is the first num_accepted nodes."""
    n = len(draft.token_ids)
    chain = main_chain_len(draft.parents, n)
    path = list(accepted_node_indices) or list(range(num_accepted))
    if any(node >= chain for node in path):
        return "rejected_alt_hit"
    if len(path) >= chain:
        return "all_accepted"
    parents = draft.parents or []
    depth = len(path)                                       # the rejected chain position
    has_alt = any(parents[i] == depth - 1 for i in range(chain, n))
    return "rejected_alt_miss" if has_alt else "rejected_no_alt"
