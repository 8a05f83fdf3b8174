"""Which proposer drafts the round: the one with the most expected tokens per millisecond of the round.

Per request, on plain floats (no clock: the caller passes measured seconds). For each proposer

    rate = (1 + expected accepted draft tokens) / (verify(n) + cost)

where the 1 is the token every verify emits, n is the draft's size, verify(n) = base * (1 + VERIFY_SLOPE * n) with
`base` a decayed average of the measured verify times (normalized by the same factor), and cost the proposer's own
decayed average time per round (a local suffix lookup ~0, the shared store one Redis round trip, the draft model
its compute plus the link's round trip; a prefetched model block costs what waiting for it cost).

Expected accepted tokens: a suffix proposal's score (the sum of its nodes' count-ratio probabilities) times that
proposer's measured calibration (decayed accepted / decayed predicted, starting from 1); the draft model's from
its measured acceptance per position (`gateway.adaptive.DraftLengthController`, fed only the model's rounds,
and `expected_tokens`). Target-only (nothing drafted) competes too. A proposer not chosen for `PROBE_EVERY`
rounds is chosen once, so an estimate that went wrong can recover.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.adaptive import DraftLengthController, expected_tokens

LOCAL, GLOBAL, MODEL, NONE = "local", "global", "model", "none"
DECAY = 0.85                 # weight an old observation keeps per new one
VERIFY_SLOPE = 0.1           # extra verify time per drafted token, relative to a one-token verify
PRIOR_VERIFY_S = 0.15        # before any verify was measured (a CPU verify of the real pair: ~150-215 ms)
PROBE_EVERY = 16             # rounds a drafting proposer may go unchosen before it gets one round
MAX_MODEL_K = 64


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


class ProposerChoice:
    def __init__(self) -> None:
        self._verify_base = _Decayed(PRIOR_VERIFY_S, 1.0)
        self._cost: dict[str, _Decayed] = {}
        self._calibration = {LOCAL: _Decayed(1.0, 1.0), GLOBAL: _Decayed(1.0, 1.0)}
        self.model = DraftLengthController(max_k=MAX_MODEL_K, initial_k=0)
        self._unchosen: dict[str, int] = {}

    # ------------------------------------------------------------------ estimates
    def verify_s(self, num_tokens: int) -> float:
        return self._verify_base.mean * (1 + VERIFY_SLOPE * num_tokens)

    def cost_s(self, proposer: str, num_tokens: int) -> float:
        """Unmeasured = free: a proposer is tried before its cost is known (optimism under uncertainty)."""
        return self._cost[proposer].mean if proposer in self._cost else 0.0

    def expected_accepted(self, proposer: str, score_or_k: float) -> float:
        """A suffix proposer's calibrated score, or the model's expected accepted tokens for k drafts."""
        if proposer == MODEL:
            return expected_tokens(self.model.position_acceptance(), int(score_or_k)) - 1.0
        if proposer == NONE:
            return 0.0
        return self._calibration[proposer].mean * score_or_k

    def rate(self, proposer: str, score_or_k: float, num_tokens: int) -> float:
        """Expected tokens per second of a round drafted by `proposer`."""
        seconds = self.verify_s(num_tokens) + self.cost_s(proposer, num_tokens)
        return (1.0 + self.expected_accepted(proposer, score_or_k)) / max(seconds, 1e-6)

    # ------------------------------------------------------------------ decision
    def choose(self, options: dict[str, tuple[float, int]]) -> str:
        """options: proposer -> (score, or k for the model; draft size). Returns the proposer to use; NONE is
        always an option (target-only)."""
        options = {**options, NONE: (0.0, 0)}
        drafting = [p for p in options if p != NONE]
        for p in drafting:
            self._unchosen[p] = self._unchosen.get(p, 0) + 1
        starved = [p for p in drafting if self._unchosen[p] > PROBE_EVERY]
        best = starved[0] if starved else max(options, key=lambda p: self.rate(p, *options[p]))
        self._unchosen[best] = 0
        return best

    # ------------------------------------------------------------------ observations
    def observe_cost(self, proposer: str, seconds: float) -> None:
        self._cost.setdefault(proposer, _Decayed(0.0, 0.0)).add(max(0.0, seconds))

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        self._verify_base.add(max(0.0, seconds) / (1 + VERIFY_SLOPE * num_tokens))

    def observe_suffix(self, proposer: str, predicted: float, accepted: int) -> None:
        if predicted > 0:
            self._calibration[proposer].add(accepted, predicted)

    def observe_model(self, num_drafted: int, num_accepted: int, draft_s: float, verify_s: float) -> None:
        if num_drafted > 0:
            self.model.observe(min(num_drafted, MAX_MODEL_K), min(num_accepted, num_drafted, MAX_MODEL_K),
                               draft_s, verify_s)
