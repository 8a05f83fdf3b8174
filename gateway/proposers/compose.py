"""Where a request's drafting is put together from GatewayConfig, in one place: the draft model proposer, the
cache / n-gram / suffix proposers, the rule among them, and the one round cost model they all read."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.adaptive import DraftLengthController
from gateway.draft_pool import DraftPool
from gateway.proposers.base import Drafter, ModelProposer
from gateway.proposers.cache import CacheProposer
from gateway.proposers.cost_model import LocalCaps, RoundCostModel
from gateway.proposers.draft_model import ModelDrafter
from gateway.proposers.ngram import NgramProposer
from gateway.proposers.policy import ProposerPolicy
from gateway.proposers.proposer_set import ProposerSet
from gateway.proposers.suffix import LocalSuffixProposer, SharedSuffixProposer
from gateway.proposers.suffix_rule import CATCH_UP_IN_ROUND, SuffixRule
from gateway.proposers.tier_order import TierOrder
from gateway.round_outcomes import RoundOutcomes
from gateway.suffix_choice import ProposerChoice
from gateway.tiers import DraftTiers
from specmesh.config import GatewayConfig
from specmesh.spec.sampling import SamplingParams


def build_policy(tiers: DraftTiers, model: ModelProposer | None, tenant: str | None,
                 length: DraftLengthController | None = None) -> ProposerPolicy:
    """One request's policy over the tiers' proposers and `model`, with its cost model (`length`: the adaptive
    draft length's controller, None for a fixed k). Prices the model's tree width with the cost model."""
    settings, scope = tiers.settings, tiers.scope(tenant)
    proposers = ProposerSet(tiers.stats, model)
    if settings.suffix_drafting:
        proposers.sync_prefill = True            # no model round until the draft service has computed the context
        if model is not None:                    # ... nor while it recomputes a lost session's (a restart, a lease)
            model.resend_in_round_max = CATCH_UP_IN_ROUND
        choice = ProposerChoice(settings.draft_host_share)
        cost_model = RoundCostModel(length, choice)
        proposers.local_suffix = LocalSuffixProposer(settings.max_branches)
        if tiers.store is not None and scope is not None:
            proposers.shared_suffix = SharedSuffixProposer(tiers.store, scope, settings.vocab_size,
                                                           settings.context_tail, settings.max_branches)
        rule: SuffixRule | TierOrder = SuffixRule(proposers, cost_model, choice, settings.local_max_tokens,
                                                  settings.max_branches)
    else:
        cost_model = RoundCostModel(length, local_caps=LocalCaps(settings.local_max_tokens))
        if tiers.cache is not None and scope is not None:
            proposers.cache = CacheProposer(tiers.cache, scope, settings.vocab_size, settings.context_tail)
        if settings.enable_ngram:
            proposers.ngram = NgramProposer(settings.ngram_sizes)
        rule = TierOrder(proposers, cost_model)
    if model is not None and model.tree_width > 0:
        model.tree_pricing = cost_model.tree_width
    return ProposerPolicy(proposers, rule, cost_model)


@dataclass(frozen=True)
class RequestDrafting:
    """What a request drafts with (None: target-only) and the cost model its round loop feeds (None: nothing to
    learn: a fixed k and no policy)."""
    drafter: Drafter | None
    cost_model: RoundCostModel | None


@dataclass(frozen=True)
class DraftSession:
    """The request's side of a draft session: its id, sampling, deadline and where its tree outcomes are counted."""
    session_id: str
    sampling: SamplingParams
    timeout_s: float
    outcomes: RoundOutcomes


def request_drafting(config: GatewayConfig, num_draft_tokens: int, session: DraftSession,
                     draft: DraftPool | None, tiers: DraftTiers | None, tenant: str | None) -> RequestDrafting:
    """The draft model (when a draft service is configured), the tiers' policy over it (when tiers are), and the
    round cost model: adaptive when `config.adaptive_draft_length`. num_draft_tokens 0: no drafting."""
    length = None
    if config.adaptive_draft_length and num_draft_tokens > 0:
        length = DraftLengthController(max_k=num_draft_tokens, initial_k=num_draft_tokens)
    model = None
    stub = draft.pick() if draft is not None and num_draft_tokens > 0 else None
    if draft is not None and stub is not None:
        model = ModelDrafter(stub, session.session_id, session.sampling, min(config.draft_timeout_s, session.timeout_s),
                             tree_width=config.draft_tree_width, outcomes=session.outcomes,
                             branch_prefetch=config.overlap, reroute=draft.reroute,
                             cleanup_retry_s=config.end_session_retry_s)
    if tiers is not None and num_draft_tokens > 0:
        policy = build_policy(tiers, model, tenant, length)
        return RequestDrafting(policy, policy.cost_model)
    cost_model = RoundCostModel(length) if length is not None else None
    if model is not None and cost_model is not None and model.tree_width > 0:
        model.tree_pricing = cost_model.tree_width
    return RequestDrafting(model, cost_model)
