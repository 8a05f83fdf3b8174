"""The draft's vocabulary-subset LM head: same logits on kept ids, -inf elsewhere, and exact output end to end."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoTokenizer

from specmesh.engine.int8_linear import quantize_linears
from specmesh.engine.vocab_head import SubsetHead, kept_token_ids, restrict_lm_head
from specmesh.models import resolve_model_dir
from specmesh.ops import client
from tests.stack import reference_greedy, start_draft, start_gateway, start_verifier


class _Model(nn.Module):
    def __init__(self, vocab: int = 50, hidden: int = 8) -> None:
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


def test_kept_ids_are_the_first_n_plus_special_tokens() -> None:
    assert kept_token_ids(50, 10, [48, 3, 99, -1]).tolist() == [*range(10), 48]


def test_subset_head_matches_the_full_head_on_kept_ids() -> None:
    torch.manual_seed(0)
    model = _Model()
    full = model.lm_head
    hidden = torch.randn(3, 5, 8)
    expected = full(hidden)
    assert restrict_lm_head(model, 20, [45]) == 21
    logits = model.lm_head(hidden)
    keep = kept_token_ids(50, 20, [45])
    assert logits.shape == expected.shape
    assert torch.equal(logits[..., keep], expected[..., keep])
    dropped = torch.ones(50, dtype=torch.bool)
    dropped[keep] = False
    assert torch.isinf(logits[..., dropped]).all() and (logits[..., dropped] < 0).all()


def test_subset_head_is_quantized_with_the_rest_and_no_bigger_head_is_a_noop() -> None:
    model = _Model()
    assert restrict_lm_head(model, 100, []) == 50 and isinstance(model.lm_head, nn.Linear)
    restrict_lm_head(model, 10, [])
    assert quantize_linears(model) == 1 and isinstance(model.lm_head, SubsetHead)
    assert torch.isfinite(model.lm_head(torch.randn(2, 8))[:, :10]).all()


async def test_greedy_output_is_exact_with_a_cut_draft_head() -> None:
    verifier = await start_verifier()
    draft = await start_draft("tiny-draft", head_vocab=64)
    gateway = await start_gateway(verifier.addr, draft.addr)
    try:
        request = client.make_request("def fibonacci(n):\n    return", max_new_tokens=24, num_draft_tokens=4,
                                      ignore_eos=True)
        responses = [r async for r in client.stream(gateway.addr, request, timeout_s=60)]
        ids = [t for r in responses for t in r.token_ids]
        tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))
        assert ids == reference_greedy(tok("def fibonacci(n):\n    return")["input_ids"], 24)
        assert responses[-1].usage.num_drafted_tokens > 0
    finally:
        for running in (gateway, draft, verifier):
            await running.stop()
