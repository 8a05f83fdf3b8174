"""Adaptive draft length per session: pick the k that maximizes expected tokens per second.

Pure logic on floats and ints (no gRPC, no clock), the core of a request's round cost model (gateway/proposers/
cost_model.py): `next_k()` before drafting; after a round `observe_verify_cost(...)`, then `observe(...)`.

The model (all times in seconds)
--------------------------------
Acceptance. Position i (1-based) of a draft block is accepted with conditional probability p_i, given that
positions 1..i-1 were accepted. A round that drafted n tokens and accepted m gives, for positions 1..m, a
success each; for position m+1 (if m < n) a failure; positions after the first rejection are unobserved. We
keep exponentially decayed success/failure counts per position (decay `decay` per round, so old rounds fade)
and estimate

    a       = (S + m0 * prior) / (S + F + m0)                       pooled over all positions
    p_i     = (S_i + m1 * a) / (S_i + F_i + m1)                     per position, shrunk toward a

Using successes / (successes + failures), not accepted / drafted, is the geometric MLE: tokens after a rejection
were never tested, so counting them as failures would bias a down. Unobserved positions fall back to a.

Expected tokens per round with k drafts (the +1 is the token the verifier always emits: the correction or
the bonus token):

    E(k) = 1 + sum_{j=1..k} prod_{i=1..j} p_i          which for p_i = a is (1 - a^(k+1)) / (1 - a)

Time per round:

    T(k) = verify(k) + [k > 0] * (rtt + draft(k))

draft(k) = the draft time a round waits for: a decayed least-squares line d0 + d1 * k through the rounds' (k, draft
seconds), d0 >= 0, d1 >= 0. The draft service drafts ahead while the verifier works and a prefetch hides a whole
block, so what a round waits for is mostly the link's fixed cost (the call, the sync of the verified tokens), not k
times a draft step. Until k has spread the slope is not identifiable: a share f (`draft_fixed_share`) of the one k's
mean wait m is taken as fixed and the rest as per token, draft(k) = m (f + (1 - f) k / k_seen) (f = 0 is all per
token, which from rounds of k = 1 prices k = 4 at four times the wait and kept one stream at k <= 1; f = 1 is all
fixed, which from rounds of k = 8 prices k = 1 as dear as 8). Once k has spread, the fitted slope says what a
drafted token adds, and is kept while k settles again.
Before any drafted round of the request (after `remember`), c = decayed draft seconds / drafted tokens prices k * c.
rtt = draft link round trip (paid only when we call the draft service: k = 0 means target-only decoding); verify(k) =
v0 + v1 * x(k), a decayed least-squares line through the observed (x(k), verify_s) points, where x(k) = max(0,
k + 1 - F) counts the verified tokens beyond the F a forward takes for the cost of one (VerifyResponse.free_tokens,
measured by the verifier: 4 for int4 on a full-width AVX2 core, so k <= 3 drafts verify for about the price of
none; F = 1 until reported, then x(k) = k). While only one x has been seen the slope is not identifiable; then
verify(k) = v0 * (1 + s * x(k)) with the prior relative slope s (`verify_rel_slope`). Once the verifier reports its
own measure of one more token's cost (VerifyResponse.token_cost), that is s, always (gateway/verify_cost.py).

Load. When the verifier's forward also carries other sessions' rows, this session's rows take verifier time
from them: P(k) tokens per round (gateway/verify_cost.py: n_o rows that emit E_o tokens, t(n) the forward's cost in
one-token forwards, P(k) = E_o (t(n_o + k + 1) - t(n_o)) / t(n_o); work queued behind the forward counts too).
n_o and E_o are smoothed over the rounds' reports (`load_decay`; a verdict that needed no forward reports nothing).
Under load this session's own verify grows with the forward, not with its own rows alone: verify(k) = mean_t *
t(n_o + k + 1) / t(n_o + mean_k + 1) (mean_k the decayed mean of the drafts verified) once the verifier measured s.

Choice. The aggregate throughput: the others' rate rho (k does not change it) plus this session's net rate,

    A(k) = rho + (E(k) - P(k)) / T(k),        k* = argmax_k (E(k) - P(k)) / T(k) over [min_k, max_k]

so k = 0 (target-only, which takes P(0) for its pending row) competes with every k by the same cost. One stream:
P = 0, the rate E(k) / T(k). Many compute-bound rows and low acceptance: a drafted row costs the others about a
token and brings this session less, so k* = 0; high acceptance still drafts. No fixed batch-size threshold: the
verifier's measured t(n) decides.

Hysteresis. k changes only when the best candidate beats the current k's predicted rate by more than `margin`
(relative) for `patience` consecutive rounds; one outlier round cannot flip k (and is also damped by the decay).

Probing. At k = 0 nothing about acceptance is learned, so every `probe_every` rounds one round drafts `probe_k`
tokens; if the draft has become good, the estimate rises and k leaves 0. A probe costing T(probe_k) - T(0) more than
a target-only round, plus (P(probe_k) - P(0)) * T(0) for the others' tokens it takes (a token is worth one
target-only round), waits until that is at most `probe_budget` of the rounds' time since the last one.

Trees. With tree drafting every alternative is a leaf beside a chain token: when the target rejects that chain
token and picks the alternative, the round gains exactly one token; each alternative node costs one more verified
position, v1 seconds (the verify line's slope, the same per node as per chain token), and takes p1 = P(k + 1) - P(k)
tokens from the other sessions. With h = decayed alternative hits per alternative node (prior
`tree_prior_hit_rate`, `tree_prior_nodes` pseudo-nodes), alternatives pay when their marginal net rate beats the
round's:  (h - p1) / v1 > (E(k) - P(k)) / T(k)  (h > p1 where a node costs this session nothing). Then the full
width is used, else none; at width 0 every `probe_every`-th round still sends alternatives, so h keeps being measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.controller_memory import ControllerMemory
from gateway.decayed_line import DecayedLine
from gateway.verify_cost import VerifyCost, VerifyLine, load_penalty


@dataclass(frozen=True)
class AdaptiveParams:
    decay: float = 0.85              # per-round weight kept by old observations (effective memory ~ 1/(1-decay))
    prior_acceptance: float = 0.5    # pooled acceptance before any evidence
    prior_strength: float = 1.0      # m0: pseudo-observations behind the prior
    position_shrink: float = 2.0     # m1: pseudo-observations pulling p_i toward the pooled a
    verify_rel_slope: float = 0.1    # s: extra verify cost per drafted token, relative to a 1-token verify
    margin: float = 0.05             # switch only if the new k predicts > 5% more tokens/s
    patience: int = 2                # ... for this many consecutive rounds
    probe_every: int = 16            # at k == 0, draft probe_k tokens once every probe_every rounds at least
    probe_budget: float = 0.1        # ... and no more often than keeps the probes' extra time under this share
    probe_k: int = 2
    load_decay: float = 0.5          # smoothing of the reported load (other sessions' rows and tokens per forward)
    tree_prior_hit_rate: float = 0.2 # h before evidence: hits per alternative node (optimistic: try trees first)
    tree_prior_nodes: float = 10.0   # pseudo-nodes behind that prior
    draft_fixed_share: float = 0.5   # f: share of a round's draft wait taken as fixed (not per token) until k spreads


def expected_tokens(position_acceptance: list[float], k: int) -> float:
    """E(k) = 1 + sum_{j<=k} prod_{i<=j} p_i (tokens emitted by one round with k drafts)."""
    total, survive = 1.0, 1.0
    for p in position_acceptance[:k]:
        survive *= p
        total += survive
    return total


class DraftLengthController:
    """Per-session draft length from acceptance history, measured costs, link RTT and verifier load."""

    def __init__(self, min_k: int = 0, max_k: int = 16, initial_k: int = 4,
                 params: AdaptiveParams | None = None) -> None:
        if not 0 <= min_k <= max_k:
            raise ValueError(f"need 0 <= min_k <= max_k, got {min_k}, {max_k}")
        self.min_k, self.max_k = min_k, max_k
        self.params = params or AdaptiveParams()
        self.k = min(max(initial_k, min_k), max_k)
        self._succ = [0.0] * max_k
        self._fail = [0.0] * max_k
        self._draft_time = self._draft_tokens = 0.0
        self._draft_line = DecayedLine(self.params.decay)      # (k, draft seconds) of this request's drafted rounds
        self._draft_slope: float | None = None                 # d1 as last identified (None until k has spread)
        self._verify = VerifyLine(self.params.decay, self.params.verify_rel_slope)
        self._rtt: float | None = None
        self._other_rows = self._other_tokens = 0.0  # smoothed: other sessions' rows and tokens per forward
        self._load_seen = False
        self._streak = 0
        self._rounds_at_zero = 0
        self.rounds = 0
        self._alt_nodes = self._alt_hits = 0.0
        self._tree_rounds_off = 0

    # ------------------------------------------------------------------ estimates
    def acceptance(self) -> float:
        """Pooled conditional acceptance a."""
        p = self.params
        s, f = sum(self._succ), sum(self._fail)
        return (s + p.prior_strength * p.prior_acceptance) / (s + f + p.prior_strength)

    def position_acceptance(self) -> list[float]:
        a, m1 = self.acceptance(), self.params.position_shrink
        return [(s + m1 * a) / (s + f + m1) for s, f in zip(self._succ, self._fail, strict=True)]

    def draft_cost(self) -> float | None:
        """c: decayed draft seconds per drafted token (what `remember` carries between requests)."""
        return self._draft_time / self._draft_tokens if self._draft_tokens > 0 else None

    def draft_time(self, k: int) -> float | None:
        """draft(k): seconds a round of k drafts waits for its draft (the line d0 + d1 k; one k seen: its mean)."""
        moments = self._draft_line.moments()
        if moments is None:
            c = self.draft_cost()
            return None if c is None else k * c
        mean_k, mean_t, var_k = moments
        if var_k >= 0.25:                       # k has spread: the line's slope (kept once k settles again)
            self._draft_slope = max(0.0, self._draft_line.slope())
        elif self._draft_slope is None:         # one k seen: a share of its wait fixed, the rest per token
            return mean_t * (self.params.draft_fixed_share + (1 - self.params.draft_fixed_share) * k / mean_k)
        slope = self._draft_slope
        return max(0.0, mean_t - slope * mean_k) + slope * k

    def verify_cost(self, k: int) -> float | None:
        return self._verify(k)

    def round_time(self, k: int) -> float | None:
        verify, draft = self.verify_cost(k), self.draft_time(k) if k > 0 else 0.0
        if verify is None or draft is None:
            return None
        return verify + (0.0 if k == 0 else (self._rtt or 0.0) + draft)

    def load_penalty(self, k: int) -> float:
        """P(k): tokens the other sessions in the forward give up for this session's k drafts and pending row."""
        return load_penalty(k, self._other_rows, self._other_tokens, self._verify.slope_units,
                            self._verify.free_tokens)

    def tokens_per_second(self, k: int) -> float | None:
        """(E(k) - P(k)) / T(k): this session's tokens per second net of what it takes from the others (may be < 0)."""
        t = self.round_time(k)
        if t is None or t <= 0:
            return None
        return (expected_tokens(self.position_acceptance(), k) - self.load_penalty(k)) / t

    # ------------------------------------------------------------------ decisions
    def best_k(self) -> int:
        """argmax over k of predicted net tokens/s, ignoring hysteresis (the current k if unknown)."""
        rates = {k: self.tokens_per_second(k) for k in range(self.min_k, self.max_k + 1)}
        known = {k: r for k, r in rates.items() if r is not None}
        return max(known, key=lambda k: (known[k], -k)) if known else self.k

    def next_k(self) -> int:
        """The draft length for the coming round (call once per round)."""
        if self.k == 0 and self.max_k > 0:
            self._rounds_at_zero += 1
            if self._probe_due():
                self._rounds_at_zero = 0
                return min(self.params.probe_k, self.max_k)
        return self.k

    def _probe_due(self) -> bool:
        """At k = 0: `probe_every` rounds since the last probe, and as many more as keep the probes' extra time
        within `probe_budget` of the time spent (a dear probe waits longer)."""
        p = self.params
        if self._rounds_at_zero < p.probe_every:
            return False
        probe_k = min(p.probe_k, self.max_k)
        zero, probe = self.round_time(0), self.round_time(probe_k)
        if zero is None or probe is None:
            return True
        taken = (self.load_penalty(probe_k) - self.load_penalty(0)) * zero    # the others' tokens, in rounds
        return self._rounds_at_zero * zero * p.probe_budget >= probe - zero + taken

    def _update_k(self) -> None:
        best = self.best_k()
        now, new = self.tokens_per_second(self.k), self.tokens_per_second(best)
        if best == self.k or now is None or new is None or new - now <= abs(now) * self.params.margin:
            self._streak = 0
            return
        self._streak += 1
        if self._streak >= self.params.patience:
            self.k, self._streak, self._rounds_at_zero = best, 0, 0

    # ------------------------------------------------------------------ observations
    def observe(self, num_drafted: int, num_accepted: int, draft_s: float, verify_s: float,
                rtt_s: float | None = None, forward_ran: bool = True) -> None:
        """One finished round: tokens drafted/accepted, draft compute seconds (excluding the link RTT), verify
        seconds (as the round loop saw it), and the draft link's RTT if measured.

        With draft pipelining pass only the exposed part of the draft time and RTT (what the round actually
        waited for beyond the verify); the model then prices hidden drafting at ~0 and picks longer blocks.

        forward_ran False: the verifier answered without a forward (tokens it had decoded ahead while idle settled
        the verdict). Such a verify takes ~no time for tokens computed during earlier rounds' time, so it says nothing
        about verify(k): it stays out of the verify line (fed to it, answers in ~0 s made k = 0 look nearly free and
        held one stream at k = 0 for ~45% of its rounds on held-out prompts)."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted}, {num_drafted}")
        d = self.params.decay
        self._succ = [d * s for s in self._succ]
        self._fail = [d * f for f in self._fail]
        for i in range(min(num_accepted, self.max_k)):
            self._succ[i] += 1
        if num_accepted < num_drafted and num_accepted < self.max_k:
            self._fail[num_accepted] += 1
        if num_drafted > 0:
            self._draft_time = d * self._draft_time + max(0.0, draft_s)
            self._draft_tokens = d * self._draft_tokens + num_drafted
            self._draft_line.add(num_drafted, max(0.0, draft_s))
        if forward_ran:
            self._verify.add(num_drafted, max(0.0, verify_s))
        if rtt_s is not None:
            self._rtt = rtt_s if self._rtt is None else d * self._rtt + (1 - d) * rtt_s
        self.rounds += 1
        self._update_k()

    def alternative_hit_rate(self) -> float:
        p = self.params
        return (self._alt_hits + p.tree_prior_hit_rate * p.tree_prior_nodes) / (self._alt_nodes + p.tree_prior_nodes)

    def alternatives_pay(self) -> bool:
        """(h - p1) / v1 > (E(k) - P(k)) / T(k): an alternative node yields net tokens faster than the round does."""
        rate = self.tokens_per_second(self.k)
        base, longer = self.verify_cost(self.k), self.verify_cost(self.k + 1)
        if rate is None or base is None or longer is None:
            return True                              # nothing measured yet: try (and measure)
        per_node, net_hit = longer - base, self.alternative_hit_rate() - self.load_penalty_per_node()
        return net_hit > 0 if per_node <= 0 else net_hit / per_node > rate

    def local_draft_cap(self, longest: int) -> int:
        """A model-free draft's length (no draft compute): `longest` alone (P = 0: as before); beside other rows the
        k <= longest with the most (E(k) - P(k)) / verify(k), 0 included (cache and n-gram rounds feed E too)."""
        if self._other_rows <= 0 or longest <= 0:
            return longest
        acceptance = self.position_acceptance()
        rates = {k: (expected_tokens(acceptance, k) - self.load_penalty(k)) / v
                 for k in range(min(longest, self.max_k) + 1) if (v := self.verify_cost(k))}
        return max(rates, key=lambda k: (rates[k], -k)) if rates else longest

    def load_penalty_per_node(self) -> float:
        """p1 = P(k + 1) - P(k): the other sessions' tokens one more verified node takes."""
        return self.load_penalty(self.k + 1) - self.load_penalty(self.k)

    def tree_width(self, max_width: int) -> int:
        """Alternatives per uncertain position for the coming round (call once per round)."""
        if max_width <= 0 or self.alternatives_pay():
            self._tree_rounds_off = 0
            return max(max_width, 0)
        self._tree_rounds_off += 1
        return max_width if self._tree_rounds_off % self.params.probe_every == 0 else 0

    def observe_verify(self, num_verified: int, verify_s: float, forward_ran: bool = True) -> None:
        """A round another proposer drafted (the cache, n-gram lookup): its verify of `num_verified` drafts prices
        verify(k) like any other, but its acceptance is that proposer's, not the draft model's whose k this chooses
        (fed in, wrong n-gram drafts pulled the model's estimated acceptance, and so its k, down)."""
        if forward_ran:
            self._verify.add(num_verified, max(0.0, verify_s))

    def observe_tree(self, num_alternative_nodes: int, alternative_hit: bool) -> None:
        """A verified tree: how many alternative nodes it had and whether the accepted path took one."""
        d = self.params.decay
        self._alt_nodes = d * self._alt_nodes + num_alternative_nodes
        self._alt_hits = d * self._alt_hits + (1.0 if alternative_hit else 0.0)

    def observe_verify_cost(self, cost: VerifyCost) -> None:
        """What the verifier reported: its free tokens (the line's x from then on), its measured cost of one more
        verified token (0 = unknown), the line's slope from then on (a line fitted to rounds of a few similar k
        extrapolates badly), and the other sessions' rows and tokens in the forward (the load; a verdict that needed
        no forward, forward_rows = 0, says nothing about it). Call it before `observe` of the same round."""
        self._verify.free_tokens = cost.free_tokens
        if cost.token_cost > 0:
            self._verify.measured_slope = cost.token_cost
        if cost.forward_rows > 0:
            self.observe_load(cost.other_rows, cost.other_tokens)

    def observe_load(self, other_rows: float, other_tokens: float) -> None:
        """Other sessions' rows in the forward that verified this session's block and the tokens they got from it
        (smoothed; the first report is taken as is)."""
        d = 0.0 if not self._load_seen else self.params.load_decay
        self._other_rows = d * self._other_rows + (1 - d) * max(0.0, other_rows)
        self._other_tokens = d * self._other_tokens + (1 - d) * max(0.0, other_tokens)
        self._verify.other_rows = self._other_rows
        self._load_seen = True

    @property
    def load(self) -> tuple[float, float]:
        """(other sessions' rows, their tokens) per forward, smoothed: what the load term prices."""
        return self._other_rows, self._other_tokens

    # ------------------------------------------------------------------ memory across requests
    def memory(self) -> ControllerMemory:
        line = self._verify.points
        return ControllerMemory(tuple(self._succ), tuple(self._fail), self._draft_time, self._draft_tokens,
                                (line.w, line.sx, line.sxx, line.st, line.sxt), self._rtt,
                                self._verify.measured_slope, self._alt_nodes, self._alt_hits, self._verify.free_tokens)

    def remember(self, memory: ControllerMemory, max_rounds: float) -> None:
        """Start from what earlier requests learned, worth at most `max_rounds` rounds of evidence (a new request's
        own rounds soon outweigh it: its content may differ), and from the draft length that predicts the most
        tokens/s under it, at least 1 while speculation is allowed (k = 0 learns no acceptance but by probes)."""
        if memory.rounds <= 0:
            return
        m = memory.scaled(min(1.0, max_rounds / memory.rounds))
        n = self.max_k
        self._succ = [m.succ[i] if i < len(m.succ) else 0.0 for i in range(n)]
        self._fail = [m.fail[i] if i < len(m.fail) else 0.0 for i in range(n)]
        self._draft_time, self._draft_tokens = m.draft_time, m.draft_tokens
        line = self._verify.points
        line.w, line.sx, line.sxx, line.st, line.sxt = m.verify
        self._verify.measured_slope = m.token_cost
        self._verify.free_tokens = m.free_tokens
        self._rtt = m.rtt_s
        self._alt_nodes, self._alt_hits = m.alt_nodes, m.alt_hits
        self.k = min(max(self.best_k(), self.min_k, 1 if self.max_k > 0 else 0), self.max_k)
