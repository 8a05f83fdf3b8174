"""One round cost model per request: what a round costs and yields, per proposer, fed once per round.

`RoundCostModel.observe(RoundObservation)` is the one place a verified round is learned from (the round loop calls
it from the request's round event). Everything that decides how to draft reads the same model:

    the draft length           `draft_length()`: `DraftLengthController.next_k` (gateway/adaptive.py, whose E(k),
                               T(k), load penalty P(k), hysteresis, probing and tree derivation this model is)
    the tree width             `tree_width()`: the same controller's alternatives-pay rule
    cache / n-gram draft caps  `local_room()`: a tier's cap (doubled while its drafts are all accepted, cut to
                               accepted + 1 when not), priced under load by `local_draft_cap`
    the suffix mode's choice   `choice` (gateway/suffix_choice.py): per-proposer round costs, suffix calibrations
                               and the draft model's own acceptance, priced with this model's load term

The load term (issue 27: what this session's rows take from the other sessions in the same forward) is the
controller's, fed every round; the suffix choice reads it from there (`ProposerChoice.load`). Without an adaptive
draft length (no controller) the choice keeps its own. `memory()` / `remember()` carry all of it across requests
(gateway/learned_priors.py). Pure logic: the caller measures the seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.adaptive import DraftLengthController
from gateway.choice_memory import ChoiceMemory
from gateway.controller_memory import ControllerMemory
from gateway.draft_tree import main_chain_len
from gateway.proposers.base import NO_DRAFT, Draft
from gateway.request_state import RoundEvent
from gateway.round_outcomes import classify
from gateway.suffix_choice import MODEL, ProposerChoice
from gateway.suffix_tree import Proposal, accepted_nodes
from gateway.verify_cost import UNKNOWN_COST, VerifyCost
from protos.specmesh.v1 import common_pb2
from specmesh.spec.token_ids import common_prefix_len

LOCAL_TIERS: tuple[int, ...] = (common_pb2.DRAFT_SOURCE_CACHE, common_pb2.DRAFT_SOURCE_NGRAM)


@dataclass(frozen=True)
class RoundObservation:
    """One verified round, as the cost model learns from it."""
    source: int                          # the proposer that drafted it (common_pb2.DraftSource; NONE: target-only)
    num_drafted: int                     # draft nodes verified (a tree: chain and alternatives)
    num_accepted: int
    draft_s: float                       # seconds the round waited for its draft
    verify_s: float                      # seconds it waited for its Verify
    cost: VerifyCost = UNKNOWN_COST      # what the verifier reported about its forward's cost and load
    rtt_s: float | None = None           # the draft link's round trip, when measured
    num_alternatives: int | None = None  # a tree's nodes beside its main chain (None: a chain)
    alternative_hit: bool = False        # ... and whether the accepted path took one
    accepted_ids: tuple[int, ...] = ()   # the accepted draft tokens
    draft: Draft = NO_DRAFT              # the draft itself (the suffix choice matches it to what it proposed)

    @classmethod
    def of(cls, event: RoundEvent) -> RoundObservation:
        draft, n = event.draft, len(event.draft.token_ids)
        alternatives, hit = None, False
        if draft.parents is not None:
            alternatives = n - main_chain_len(draft.parents, n)
            hit = classify(draft, event.num_accepted, event.accepted_node_indices) == "rejected_alt_hit"
        return cls(draft.source, n, event.num_accepted, event.draft_s, event.verify_s, event.cost, None,
                   alternatives, hit, tuple(event.token_ids[:event.num_accepted]), draft)


@dataclass(frozen=True)
class SuffixRound:
    """What a suffix-mode round drafted (gateway/proposers/suffix_rule.py), to learn from once it is verified."""
    proposer: str                    # LOCAL, GLOBAL or MODEL
    suffix_from: str                 # LOCAL or GLOBAL: where `suffix` came from
    suffix: Proposal                 # the suffix part of the draft (all of it, or the branches beside the model's)
    draft: Draft
    model_len: int                   # the draft model's chain: the draft's first model_len nodes


@dataclass(frozen=True)
class CostModelMemory:
    """What a cost model learned, to start later requests from: each part's decayed sums (None: no such part)."""
    length: ControllerMemory | None = None
    choice: ChoiceMemory | None = None


class LocalCaps:
    """The cache and n-gram tiers' draft caps: doubled while a tier's drafts are all accepted, else accepted + 1."""

    def __init__(self, longest: int) -> None:
        self.longest = longest
        self.caps: dict[int, int] = dict.fromkeys(LOCAL_TIERS, longest)

    def observe(self, source: int, num_drafted: int, num_accepted: int) -> None:
        if source in self.caps:
            cap = self.caps[source] * 2 if num_accepted == num_drafted else num_accepted + 1
            self.caps[source] = max(1, min(cap, self.longest))


class RoundCostModel:
    """A request's one cost model. `length`: the adaptive draft length's controller (None: the request's fixed k);
    `choice`: suffix drafting's per-proposer estimates (None: tiers); `local_caps`: the tiers' caps (None: suffix)."""

    def __init__(self, length: DraftLengthController | None = None, choice: ProposerChoice | None = None,
                 local_caps: LocalCaps | None = None) -> None:
        self.length, self.choice, self.local_caps = length, choice, local_caps
        if choice is not None and length is not None:
            choice.load = length                  # one load term: the one fed every round
        self._suffix_round: SuffixRound | None = None

    # ------------------------------------------------------------------ reads
    def draft_length(self, fixed: int) -> int:
        """The draft model's length for the coming round (call once per round); `fixed` without adaptation."""
        return self.length.next_k() if self.length is not None else fixed

    def tree_width(self, max_width: int) -> int:
        """Alternatives per uncertain position for the coming model round (call once per round)."""
        if self.length is not None:
            return self.length.tree_width(max_width)
        if self.choice is not None:
            return self.choice.model.tree_width(max_width)
        return max_width

    def local_room(self, source: int, room: int) -> int:
        """A cache / n-gram draft's length: the tier's cap, priced under load (no draft compute: E(k) - P(k) over
        verify(k), `DraftLengthController.local_draft_cap`)."""
        n = min(room, self.local_caps.caps[source]) if self.local_caps is not None else room
        return self.length.local_draft_cap(n) if self.length is not None else n

    def model_could_pay(self, num_tokens: int, alone: bool = False) -> bool:
        """Whether a draft model round of `num_tokens` could beat target-only at its best under the load last
        reported (the suffix choice's `could_pay`); `alone` (the gateway runs no other request): yes unless the draft
        service shares the verifier's cores. Without a suffix choice, yes (the adaptive length probes the model)."""
        if num_tokens <= 0:
            return False
        if self.choice is None or (alone and self.choice.draft_host_share <= 0):
            return True
        return self.choice.could_pay(MODEL, num_tokens)

    def draft_prefill_could_pay(self, num_tokens: int, max_new_tokens: int, target_prefill_s: float) -> bool:
        """Whether the draft service's prefill of this request's prompt could be repaid by its model rounds (the
        suffix choice's `prefill_could_pay`: on a host shared with the verifier, not a long document with a short
        answer). Without a suffix choice, yes."""
        if self.choice is None:
            return True
        return self.choice.prefill_could_pay(num_tokens, max_new_tokens, target_prefill_s)

    # ------------------------------------------------------------------ observations
    def drafted_suffix(self, round: SuffixRound | None) -> None:
        """The suffix rule's note of what this round's draft is made of (None: nothing drafted)."""
        self._suffix_round = round

    def observe_proposer_cost(self, proposer: str, seconds: float) -> None:
        """A suffix-mode proposal's own time (a lookup, a draft model round), measured as it is made."""
        if self.choice is not None:
            self.choice.observe_cost(proposer, seconds)

    def observe_start(self, cost: VerifyCost) -> None:
        """What the verifier's prefill forward said of its cost and load (StartSessionResponse): the first round is
        priced beside the sessions already there, not as if alone."""
        if self.length is not None:
            self.length.observe_verify_cost(cost)
        if self.choice is not None:
            self.choice.observe_report(cost)

    def observe(self, round: RoundObservation) -> None:
        """The one call per verified round."""
        if self.length is not None:
            forward_ran = round.cost.forward_rows > 0       # (no forward: not a verify time)
            self.length.observe_verify_cost(round.cost)   # first: the round's verify time is priced with it
            if round.source in LOCAL_TIERS:               # acceptance per proposer: not the draft model's
                self.length.observe_verify(round.num_drafted, round.verify_s, forward_ran)
            else:
                self.length.observe(round.num_drafted, round.num_accepted, round.draft_s, round.verify_s,
                                    round.rtt_s, forward_ran=forward_ran)
            if round.num_alternatives is not None:
                self.length.observe_tree(round.num_alternatives, round.alternative_hit)
        if self.local_caps is not None:
            self.local_caps.observe(round.source, round.num_drafted, round.num_accepted)
        done, self._suffix_round = self._suffix_round, None
        if self.choice is not None and done is not None and done.draft is round.draft:
            _learn_suffix_round(self.choice, done, round)
        elif self.choice is not None and round.num_drafted == 0:
            self.choice.observe_undrafted(round.verify_s, round.cost)

    # ------------------------------------------------------------------ memory across requests
    def memory(self) -> CostModelMemory:
        return CostModelMemory(self.length.memory() if self.length is not None else None,
                               self.choice.memory() if self.choice is not None else None)

    def remember(self, memory: CostModelMemory, max_rounds: float) -> None:
        """Start from what earlier requests learned, worth at most `max_rounds` rounds of evidence."""
        if self.length is not None and memory.length is not None:
            self.length.remember(memory.length, max_rounds)
        if self.choice is not None and memory.choice is not None:
            self.choice.remember(memory.choice, max_rounds)


def _learn_suffix_round(choice: ProposerChoice, done: SuffixRound, round: RoundObservation) -> None:
    """Feeds a suffix-mode round to the choice: verify time and the verifier's cost of one more token, and
    acceptance of what each part drafted."""
    choice.observe_verify(len(done.draft.token_ids), round.verify_s, round.cost, done.proposer)
    accepted_ids = list(round.accepted_ids)
    if done.proposer == MODEL:
        # the model's own chain (a tree from the draft service puts its alternatives after the chain)
        chain_len = main_chain_len(done.draft.parents, done.model_len)
        chain = done.draft.token_ids[:chain_len]
        accepted_on_chain = common_prefix_len(chain, accepted_ids)
        choice.observe_model(len(chain), accepted_on_chain, choice.cost_s(MODEL, len(chain)), round.verify_s)
        if done.model_len > chain_len:
            choice.model.observe_tree(done.model_len - chain_len, round.num_accepted > accepted_on_chain)
    if done.proposer != MODEL or len(done.draft.token_ids) > done.model_len:
        choice.observe_suffix(done.suffix_from, done.suffix, accepted_nodes(done.suffix, accepted_ids))
