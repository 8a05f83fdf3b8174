"""Where a round's draft tokens come from: one proposer a file, composed by one policy.

    base.py             Draft, the Proposer protocol, the Drafter a generation drafts with
    cache.py            the draft cache (verified continuations of earlier requests) and the writer that fills it
    ngram.py            n-gram lookup in the request's own context
    suffix.py           suffix trees: the request's own context, the shared store of verified outputs
    draft_model.py      the draft service (ModelDrafter)
    proposer_set.py     a request's proposers and the counters they bump
    tier_order.py       the default rule: cache -> n-gram -> draft model, the first with a draft
    suffix_rule.py      suffix drafting's rule: suffix proposals or the draft model, by expected tokens per second
    cost_model.py       the one round cost model (RoundCostModel), fed once per round (RoundObservation)
    policy.py           ProposerPolicy: proposers + a rule + the cost model (the Drafter)
    compose.py          builds them from GatewayConfig, in one place

Nothing is imported here, so importing one module of the package does not import the others.
"""
