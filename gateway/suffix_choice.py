"""Which proposer drafts the round: the one with the most expected tokens per millisecond of the round.

Per request, on plain floats (no clock: the caller passes measured seconds). For each proposer

    rate = (1 + expected accepted draft tokens - P(n)) / (verify(n) + cost)

where the 1 is the token every verify emits, n is the draft's size, verify(n) = base * (1 + s * x(n)) with `base` a
decayed average of the drafted rounds' measured verify times (normalized by the same factor; an undrafted round's
measured time pulls it by ANCHOR_WEIGHT rounds), x(n) = max(0, n + 1 - F) the verified tokens beyond the F free ones
and s the verifier's own measure of one more token's cost (VerifyResponse.token_cost and .free_tokens,
gateway/verify_cost.py; `VERIFY_SLOPE` and F = 1 until it reports them), and cost the proposer's own decayed average
time per round (a local suffix lookup ~0, the shared store one Redis round trip, the draft model its compute plus the
link's round trip; a prefetched model block costs what waiting for it cost), and P(n) the tokens the other sessions in
the verifier's forward give up for this round's n + 1 rows (the load term of gateway/adaptive.py and
gateway/verify_cost.py, read from the request's round cost model, gateway/proposers/cost_model.py, whose controller
is fed the verifier's report every round: one load estimate per request; a choice on its own reads its model
controller's). Without other sessions P = 0.

Target-only's round (nothing drafted) is priced by its own measured time, not by the line at n = 0: the verifier
decodes ahead while the gateway turns a round around, so an undrafted verify finds its token computed or in flight
(`observe_undrafted`). With the draft model on the verifier's cores a model round's verify runs beside the draft
service drafting the next block ahead; its excess over the line is the model's cost.

Expected accepted tokens: for a suffix proposal, the sum over its nodes of the node's count-ratio probability
times that proposer's measured calibration at the node's depth (decayed accepted / decayed predicted per depth,
shrunk toward the proposer's pooled calibration, which starts from 1); for the draft model, from its measured
acceptance per position (`gateway.adaptive.DraftLengthController`, fed only the model's rounds, and
`expected_tokens`). Target-only (nothing drafted) competes too. A proposer not chosen for `PROBE_EVERY` rounds is
chosen once, so an estimate that went wrong can recover; one whose round costs much more than the best one's waits
longer, so that probes take at most `PROBE_BUDGET` of the time (on a CPU where verifying drafts is dear, a draft
model round can cost five target-only rounds: probing it every 16 rounds cost a quarter of the decode time), a
budget the sessions in the verifier's forward share (each gets PROBE_BUDGET / (1 + other rows)). The
draft model is chosen over target-only until `MODEL_TRIALS` of its rounds of this request were verified: its
acceptance differs most between requests (chat ~0.4, code ~0.9), and estimates a request starts from
(gateway/learned_priors.py, or one slow first round) would otherwise keep it from being measured on this request.

Under load (P(0) > 0: other sessions share the forward) neither a trial nor a probe is made of a proposer whose
round could not beat target-only even if every drafted token were accepted at `BEST_CASE_ACCEPTANCE` (`could_pay`,
the same rate with its measured cost and the load term): there the others' lost tokens and the proposer's own time
rule it out whatever the round would find (8 streams of the real pair, 2-core Zen 4: the draft model's round took
~570 ms beside ~160 ms target-only rounds, and the trials were most of its 34 rounds). Alone, a trial is always
made where the draft service has a host of its own: a noisy cost measure (a tiny model's milliseconds) must not stop
the acceptance from being measured. With the draft on the verifier's cores (`draft_host_share` > 0, as `specmesh up`
and the benchmarks' stacks set it on 2 cores) the trials, and the draft prefill they need, take the verifier's cores,
so there alone is priced as under load: no trial where the best case could not pay. The
request's first round knows the load: the verifier reports it with the prefill (StartSessionResponse), and a probe
counts what its rows take from the others in its budget, as the adaptive draft length's probes do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.adaptive import DraftLengthController, expected_tokens
from gateway.choice_memory import ChoiceMemory
from gateway.suffix_tree import Proposal
from gateway.verify_cost import UNKNOWN_COST, VerifyCost, excess_tokens

LOCAL, GLOBAL, MODEL, NONE = "local", "global", "model", "none"
DECAY = 0.85                 # weight an old observation keeps per new one
VERIFY_SLOPE = 0.1           # extra verify time per drafted token, relative to a one-token verify (until measured)
PRIOR_VERIFY_S = 0.15        # before any verify was measured (a CPU verify of the real pair: ~150-215 ms)
ANCHOR_WEIGHT = 0.5          # rounds' worth of the undrafted round time in the drafted verify line (verify_s)
PROBE_EVERY = 16             # rounds a drafting proposer may go unchosen before it gets one round
PROBE_BUDGET = 0.1           # ... at least: its extra round time over the best's, per best-round time spent since
MODEL_TRIALS = 2             # verified model rounds every request gets, whatever the estimates (under load: if they
                             # could pay)
BEST_CASE_ACCEPTANCE = 0.9   # per drafted token: the most a trial or a probe under load is assumed to find
PRIOR_DRAFT_TOKEN_RATIO = 1 / 3   # a draft model token's compute over a target token's, until a model round is
                                  # measured (the real pair: 0.5B against 1.5B weights)
MAX_MODEL_K = 64
MAX_DEPTH = 32               # suffix calibration per depth up to here (deeper nodes share the last)
DEPTH_SHRINK = 2.0           # pseudo-observations pulling a depth's calibration toward the pooled one


@dataclass
class _Decayed:
    """A decayed average that starts from a prior weight."""
    total: float
    weight: float

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total = DECAY * self.total + value
        self.weight = DECAY * self.weight + weight

    @property
    def mean(self) -> float:
        return self.total / self.weight if self.weight > 0 else 0.0


class LoadPricing(Protocol):
    """The load term P(n) (gateway/adaptive.py): a request's cost model's one estimate, or the choice's own."""

    def load_penalty(self, k: int) -> float: ...

    @property
    def load(self) -> tuple[float, float]: ...


class ProposerChoice:
    def __init__(self, draft_host_share: float = 0.0) -> None:
        # The share of the verifier's compute a running draft model takes from it: 0 on a host of its own; on the
        # verifier's host, the draft's threads over the verifier's (`specmesh up` on 2 shared cores: 1).
        self.draft_host_share = draft_host_share
        self._verify_base = _Decayed(0.0, 0.0)     # drafted rounds' verify times, over their growth (see verify_s)
        self.verify_slope = VERIFY_SLOPE
        self.free_tokens = 1                        # verified tokens that cost about what one does
        self._cost: dict[str, _Decayed] = {}
        self._calibration = {p: _Calibration() for p in (LOCAL, GLOBAL)}
        self.model = DraftLengthController(max_k=MAX_MODEL_K, initial_k=0)
        self.load: LoadPricing = self.model         # a request's cost model points it at its own controller
        self._unchosen: dict[str, int] = {}
        self._model_rounds = 0                      # verified model rounds of this request (not remembered ones)
        self._rounds = 0.0                          # decayed number of verified rounds observed

    # ------------------------------------------------------------------ estimates
    def verify_s(self, num_tokens: int) -> float:
        """A verify of `num_tokens` drafts: the drafted rounds' line, base * (1 + s * x(n)). The base is their
        measured verify times over that growth, pulled by ANCHOR_WEIGHT rounds' worth toward an undrafted round's
        measured time once there is one, so that a request that has drafted nothing yet prices drafts on what it
        measured (a tiny model verifies in ~10 ms: against a 150 ms guess no draft would ever be tried); with
        neither, PRIOR_VERIFY_S."""
        total, weight = self._verify_base.total, self._verify_base.weight
        if NONE in self._cost:
            total, weight = total + ANCHOR_WEIGHT * self._cost[NONE].mean, weight + ANCHOR_WEIGHT
        base = total / weight if weight > 0 else PRIOR_VERIFY_S
        return base * (1 + self.verify_slope * excess_tokens(num_tokens, self.free_tokens))

    def cost_s(self, proposer: str, num_tokens: int) -> float:
        """Unmeasured = free: a proposer is tried before its cost is known (optimism under uncertainty)."""
        return self._cost[proposer].mean if proposer in self._cost else 0.0

    def expected_model(self, k: int) -> float:
        """The draft model's expected accepted tokens for a k-token chain."""
        return expected_tokens(self.model.position_acceptance(), k) - 1.0

    def expected_suffix(self, proposer: str, proposal: Proposal) -> float:
        """A suffix proposal's expected accepted tokens: its nodes' probabilities, calibrated per depth."""
        calibration = self._calibration[proposer]
        return sum(calibration.at(d) * p for d, p in zip(depths(proposal.parents), proposal.probs, strict=True))

    def trimmed(self, proposer: str, proposal: Proposal) -> Proposal:
        """The proposal's prefix with the most expected tokens per second (its nodes come most likely first, so a
        long tail of unlikely nodes can cost more verify time than it brings, except within the free tokens)."""
        calibration = self._calibration[proposer]
        best_n, best_rate, expected = 0, float("-inf"), 0.0     # (net rates are < 0 under heavy load)
        for n, (d, p) in enumerate(zip(depths(proposal.parents), proposal.probs, strict=True), start=1):
            expected += calibration.at(d) * p
            rate = self.rate(proposer, expected, n)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return proposal if best_n == len(proposal.token_ids) else proposal.prefix(best_n)

    def round_s(self, proposer: str, num_tokens: int) -> float:
        """Expected seconds of a round drafted by `proposer` (`num_tokens` drafts): its cost plus the verify. An
        undrafted round's is its own measured time once there is one (`observe_undrafted`)."""
        if proposer == NONE:
            return self._undrafted_s()
        return self.verify_s(num_tokens) + self.cost_s(proposer, num_tokens)

    def rate(self, proposer: str, expected: float, num_tokens: int) -> float:
        """Expected net tokens per second of a round drafted by `proposer` (`expected` accepted of `num_tokens`):
        less what its rows take from the other sessions in the forward and what its draft's compute takes from
        their forwards on a shared host."""
        net = 1.0 + expected - self.load.load_penalty(num_tokens) - self.contention(proposer, num_tokens)
        return net / max(self.round_s(proposer, num_tokens), 1e-6)

    def contention(self, proposer: str, num_tokens: int) -> float:
        """C: tokens the other sessions give up while the draft model computes on the verifier's cores,

            C = share * rho_o * cost_s(MODEL),        rho_o = E_o / verify_s(0)

        (E_o: the other sessions' tokens per forward, smoothed; verify_s(0) about one forward's time). 4 streams of
        the real pair on 2 cores: the forwards beside a running draft took 76 ms instead of 54, and a step that
        decodes ahead gave the draft its core (1 thread: 100 ms instead of 59). 0 alone, for local proposers, and
        for a draft service on a host of its own."""
        if proposer != MODEL or self.draft_host_share <= 0:
            return 0.0
        other_tokens = self.load.load[1]
        return self.draft_host_share * other_tokens / max(self.verify_s(0), 1e-6) * self.cost_s(MODEL, num_tokens)

    # ------------------------------------------------------------------ decision
    def choose(self, options: dict[str, tuple[float, int]]) -> str:
        """options: proposer -> (expected accepted tokens, draft size). Returns the proposer to use; NONE is
        always an option (target-only)."""
        options = {**options, NONE: (0.0, 0)}
        drafting = [p for p in options if p != NONE]
        for p in drafting:
            self._unchosen[p] = self._unchosen.get(p, 0) + 1
        best = max(options, key=lambda p: self.rate(p, *options[p]))
        best_s = self.round_s(best, options[best][1])
        budget = self.probe_budget()
        starved = [p for p in drafting if p != best and self._unchosen[p] > PROBE_EVERY
                   and self._unchosen[p] * best_s * budget >= self._probe_s(p, options[p][1], best_s)
                   and self.could_pay(p, options[p][1])]
        best = starved[0] if starved else best
        if best == NONE and MODEL in options and self._model_rounds < MODEL_TRIALS \
                and self.could_pay(MODEL, options[MODEL][1]):
            best = MODEL
        self._unchosen[best] = 0
        return best

    def probe_budget(self) -> float:
        """The share of this request's time its probes may cost: PROBE_BUDGET of the verifier's, shared by the
        sessions in its forward (1 + the other rows, smoothed), so that all of them together probe within it. Each
        request's probes alone kept within PROBE_BUDGET of its own time: at 8 streams of the real pair (2-core Intel)
        nearly every drafted round was a probe (~340 suffix rounds a pass of 32 requests, 2.4 drafts at ~0.45
        accepted, where a drafted row beside 7 others costs ~0.15 of a forward), the defaults 0.94-0.98x of
        target-only."""
        return PROBE_BUDGET / (1.0 + max(0.0, self.load.load[0]))

    def _probe_s(self, proposer: str, num_tokens: int, best_s: float) -> float:
        """What a probe of `proposer` costs over the best round: its extra time, plus the tokens its rows take from
        the other sessions in the forward beyond what the best round's take, at the best round's time per round."""
        taken = self.load.load_penalty(num_tokens) - self.load.load_penalty(0) + self.contention(proposer, num_tokens)
        return self.round_s(proposer, num_tokens) - best_s + max(0.0, taken) * best_s

    def could_pay(self, proposer: str, num_tokens: int) -> bool:
        """Alone (no other rows in the forward) with the draft service on a host of its own: always. Under load, or
        with the draft on the verifier's cores (`draft_host_share` > 0): whether a round of `num_tokens` drafts by
        `proposer` would beat target-only if each draft were accepted at BEST_CASE_ACCEPTANCE, at the proposer's
        measured cost (unmeasured: free) and what its rows take from the others (16 streams of the real pair on a
        compute-bound CPU: P(4) ~ 3.9 tokens, more than a 4-token draft can bring). On a shared host a hopeless
        trial is not harmless even alone: a 2-core Zen 1 (extra rows 0.3-0.45 of a forward, the 0.5B draft at ~0.55
        of the target's time a token) gave one stream's 4-token model trials 452 ms for 3.3 tokens against 95 ms
        target-only rounds, and the draft prefills made for them slowed the verifier's forwards meanwhile."""
        if self.load.load_penalty(0) <= 0 and self.draft_host_share <= 0:   # (no other rows: no contention either)
            return True
        best_rate, none_rate = self._best_case_rates(proposer, num_tokens)
        return best_rate > none_rate

    def _best_case_rates(self, proposer: str, num_tokens: int) -> tuple[float, float]:
        """(rate of a round of `num_tokens` drafts by `proposer`, each accepted at BEST_CASE_ACCEPTANCE; rate of an
        undrafted round)."""
        best_case = sum(BEST_CASE_ACCEPTANCE ** i for i in range(1, num_tokens + 1))
        return self.rate(proposer, best_case, num_tokens), self.rate(NONE, 0.0, 0)

    def prefill_could_pay(self, num_tokens: int, max_new_tokens: int, target_prefill_s: float) -> bool:
        """With the draft on the verifier's cores (`draft_host_share` > 0): whether the draft service's prefill of a
        prompt that took the verifier `target_prefill_s` could be repaid by model rounds of `num_tokens` drafts at
        their best (BEST_CASE_ACCEPTANCE, as `could_pay`) over all `max_new_tokens` tokens of the request. The
        prefill's compute is the verifier's times the draft's cost per token over the target's (a measured model
        round's time per drafted token over an undrafted verify's; PRIOR_DRAFT_TOKEN_RATIO before one), and on
        shared cores the verifier's forwards give up that much time; the most model rounds can save is the
        request's tokens at target-only's rate minus at the model's best rate:

            ratio * target_prefill_s  <  max_new_tokens * (1 / rate(none) - 1 / rate(model, best case))

        A 3,900-token document the verifier prefilled in ~31 s costs the 0.5B draft ~10 s of the 2 shared cores,
        more than 96 tokens at their best could save (~3.5 s); a 100-token chat prompt costs ~0.3 s. On a host of its
        own the draft's prefill takes nothing from the verifier: always."""
        if self.draft_host_share <= 0:
            return True
        if num_tokens <= 0:
            return False
        model_rate, none_rate = self._best_case_rates(MODEL, num_tokens)
        if model_rate <= none_rate or none_rate <= 0:
            return False
        saved_s = max_new_tokens * (1 / none_rate - 1 / model_rate)
        ratio = PRIOR_DRAFT_TOKEN_RATIO
        if MODEL in self._cost:
            ratio = self.cost_s(MODEL, num_tokens) / num_tokens / max(self.verify_s(0), 1e-6)
        return ratio * target_prefill_s < saved_s

    # ------------------------------------------------------------------ observations
    def observe_cost(self, proposer: str, seconds: float) -> None:
        self._cost.setdefault(proposer, _Decayed(0.0, 0.0)).add(max(0.0, seconds))

    def observe_verify(self, num_tokens: int, seconds: float, cost: VerifyCost = UNKNOWN_COST,
                       proposer: str = NONE) -> None:
        """A verify of `num_tokens` drafts by `proposer` took `seconds`; cost: what the verifier reported about its
        forward's cost (a token_cost of 0 = not reported: keep the last one).

        With the draft model on the verifier's cores (`draft_host_share` > 0), a model round's verify runs beside the
        draft service's draft-ahead of the next block, which takes a core from the forward: on a 2-core Zen 4, one
        stream's model rounds answered from drafted-ahead blocks took 5-47 ms to propose and 113-128 ms to verify 5
        tokens (its undrafted verifies: ~45 ms). Booked as a verify, that time made the model look nearly free and
        every round (target-only's too) look dear, and the choice kept the model in 61 rounds of a pass that ran
        0.78x the pass before it. So there the verify's excess over a plain verify of that size (an undrafted
        round's time on the verify line) is charged to the model's round cost, and the line learns the plain part."""
        self.observe_report(cost)
        self._rounds = DECAY * self._rounds + 1.0
        growth = 1 + self.verify_slope * excess_tokens(num_tokens, self.free_tokens)
        if proposer == MODEL and self.draft_host_share > 0:
            plain = self._undrafted_s() * growth
            self._charge(MODEL, seconds - plain)
            seconds = min(seconds, plain)
        self._verify_base.add(max(0.0, seconds) / growth)

    def _undrafted_s(self) -> float:
        """An undrafted round's time: measured, else the drafted rounds' line at no drafts."""
        return self._cost[NONE].mean if NONE in self._cost else self.verify_s(0)

    def observe_undrafted(self, seconds: float, cost: VerifyCost = UNKNOWN_COST) -> None:
        """An undrafted round's verify took `seconds`. Its time is target-only's round time, kept apart from the
        drafted rounds' verify line: the verifier decodes ahead while the gateway turns the round around, so an
        undrafted verify finds its token computed or in flight, where a verify with drafts needs its own forward
        (and stops a step decoding ahead). One stream of the real pair on a 2-core Zen 4: 43 ms undrafted against 59
        ms for a 3-draft suffix round; priced by the drafted rounds' line, target-only's round looked ~53 ms, and
        drafts that would bring 0.1-0.2 tokens looked worth a round that costs a third more."""
        self.observe_report(cost)
        self._rounds = DECAY * self._rounds + 1.0
        self.observe_cost(NONE, seconds)

    def _charge(self, proposer: str, seconds: float) -> None:
        """Adds `seconds` (at least 0) to the proposer's last measured round cost."""
        measured = self._cost.get(proposer)
        if measured is not None:
            measured.total += max(0.0, seconds)

    def observe_report(self, cost: VerifyCost) -> None:
        """What the verifier said of a forward's cost and load (a verify's, or the prefill's at the start)."""
        self.free_tokens = cost.free_tokens
        if cost.token_cost > 0:
            self.verify_slope = cost.token_cost
        self.model.observe_verify_cost(cost)

    def observe_suffix(self, proposer: str, proposal: Proposal, accepted_nodes: list[int]) -> None:
        """A verified suffix proposal and the indices of its nodes on the accepted path."""
        if proposal.token_ids:
            self._calibration[proposer].add(proposal, accepted_nodes)

    def observe_model(self, num_drafted: int, num_accepted: int, draft_s: float, verify_s: float) -> None:
        self._model_rounds += 1
        if num_drafted > 0:
            self.model.observe(min(num_drafted, MAX_MODEL_K), min(num_accepted, num_drafted, MAX_MODEL_K),
                               draft_s, verify_s)

    # ------------------------------------------------------------------ memory across requests
    def memory(self) -> ChoiceMemory:
        return ChoiceMemory(
            self._rounds, (self._verify_base.total, self._verify_base.weight), self.verify_slope,
            tuple((p, c.total, c.weight) for p, c in self._cost.items()),
            tuple((p, c.pooled.total, c.pooled.weight, tuple(c.accepted), tuple(c.predicted))
                  for p, c in self._calibration.items()),
            self.model.memory(), self.free_tokens)

    def remember(self, memory: ChoiceMemory, max_rounds: float) -> None:
        """Start from what earlier requests learned, worth at most `max_rounds` verified rounds: measured costs
        instead of "unmeasured = free", calibrations instead of trusting count ratios, the model's acceptance."""
        if memory.rounds <= 0:
            return
        m = memory.scaled(min(1.0, max_rounds / memory.rounds))
        self._rounds = m.rounds
        self._verify_base = _Decayed(*m.verify_base)
        self.verify_slope = m.verify_slope
        self.free_tokens = m.free_tokens
        self._cost = {p: _Decayed(t, w) for p, t, w in m.costs}
        for p, total, weight, accepted, predicted in m.calibrations:
            if p in self._calibration:
                c = self._calibration[p]
                c.pooled, c.accepted, c.predicted = _Decayed(total, weight), list(accepted), list(predicted)
        if m.model is not None:
            self.model.remember(m.model, max_rounds)
            self.model.k = 0                      # the model's chain length is chosen per round here, not from k


def depths(parents: list[int]) -> list[int]:
    """1-based depth of each node of a token tree (a child of the pending token has depth 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


class _Calibration:
    """Accepted / predicted for one suffix proposer, pooled and per depth (decayed per observed round)."""

    def __init__(self) -> None:
        self.pooled = _Decayed(1.0, 1.0)
        self.accepted = [0.0] * MAX_DEPTH
        self.predicted = [0.0] * MAX_DEPTH

    def at(self, depth: int) -> float:
        d = min(depth, MAX_DEPTH) - 1
        return (self.accepted[d] + DEPTH_SHRINK * self.pooled.mean) / (self.predicted[d] + DEPTH_SHRINK)

    def add(self, proposal: Proposal, accepted_nodes: list[int]) -> None:
        self.accepted = [DECAY * a for a in self.accepted]
        self.predicted = [DECAY * p for p in self.predicted]
        node_depths = depths(proposal.parents)
        for d, p in zip(node_depths, proposal.probs, strict=True):
            self.predicted[min(d, MAX_DEPTH) - 1] += p
        for i in accepted_nodes:
            self.accepted[min(node_depths[i], MAX_DEPTH) - 1] += 1
        self.pooled.add(len(accepted_nodes), proposal.score)
