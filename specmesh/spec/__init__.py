"""Decoding math of exact speculative decoding, on plain ints, lists and tensors: sampling parameters and
distributions (`sampling`), the chain and tree rejection samplers that keep speculation exact (`rejection`,
`tree_rejection`), draft token trees (`tree`), seeded coupling (`seeded`), repetition penalty and logit bias
(`logit_transforms`), prompt lookup (`ngram`) and token-id helpers (`token_ids`). No I/O, no gRPC, no model: any
service or the engine may import it; it imports nothing of specmesh but itself.
"""
