"""Batch-invariant int8 and int4 numerics: a k-token verify gives bit-identical logits to k one-token decodes, so
greedy speculation on a quantized target equals target-only decoding of that target through the same stack, token
for token."""

from __future__ import annotations

import copy

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from specmesh.engine.build import QUANTIZERS
from specmesh.engine.model_runner import ForwardItem, ModelRunner
from specmesh.models import resolve_model_dir
from tests.stack import start_draft, start_gateway, start_verifier
from tests.test_e2e_greedy import PROMPTS, generate


@pytest.mark.parametrize(("dtype", "kv_dtype"), [("int8", torch.float32), ("int4", torch.float32),
                                               ("int4", torch.float16)])
def test_k_token_forward_is_bit_identical_to_one_token_steps(dtype: str, kv_dtype: torch.dtype) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("tiny-target")), dtype=torch.float32)
    QUANTIZERS[dtype][0](model)
    runner = ModelRunner(model, num_blocks=64, block_size=4, kv_dtype=kv_dtype, batch_invariant=True)
    ids = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    table = list(range(16))          # block b holds positions 4b .. 4b + 3
    runner.forward([ForwardItem(ids[:12], 0, table, 1)])
    block = runner.forward([ForwardItem(ids[12:20], 12, table, 8)])[0]           # 8 tokens at once
    single = [runner.forward([ForwardItem(ids[i:i + 1], i, table, 1)])[0][0] for i in range(12, 20)]
    assert torch.equal(block, torch.stack(single))


def test_dynamic_int8_is_not_batch_invariant() -> None:
    """The control: torch's dynamic int8 (one activation scale per forward) does change with the batch."""
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("tiny-target")), dtype=torch.float32)
    dynamic = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    x = torch.randn(6, model.config.hidden_size) * torch.tensor([[1.0], [30.0], [1.0], [1.0], [1.0], [1.0]])
    layer = dynamic.model.layers[0].mlp.gate_proj
    assert not torch.equal(layer(x)[0], layer(x[:1])[0])


@pytest_asyncio.fixture(scope="module", loop_scope="session",
                        params=[("int8", "auto"), ("int4", "auto"), ("int4", "float32")])
async def quantized_stack(request):
    """A quantized verifier and draft, on half KV caches ("auto" for int8 / int4) and on float32 ones."""
    dtype, kv_cache_dtype = request.param
    verifier = await start_verifier(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    same = await start_draft("tiny-draft", dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    unrelated = await start_draft("tiny-draft-unrelated")
    gateways = {"same": await start_gateway(verifier.addr, same.addr),
                "unrelated": await start_gateway(verifier.addr, unrelated.addr)}
    yield gateways
    for running in (*gateways.values(), same, unrelated, verifier):
        await running.stop()


@pytest.mark.parametrize("k", [1, 3, 5, 8])
async def test_speculation_equals_target_only_of_the_same_quantized_target(quantized_stack, k: int) -> None:
    for prompt in PROMPTS[:4]:
        expected, _, _ = await generate(quantized_stack["same"].addr, prompt, max_new_tokens=32, num_draft_tokens=0,
                                        ignore_eos=True)
        for draft in ("same", "unrelated"):
            ids, _, responses = await generate(quantized_stack[draft].addr, prompt, max_new_tokens=32,
                                               num_draft_tokens=k, ignore_eos=True)
            assert ids == expected, (draft, k, prompt)
            usage = responses[-1].usage
            if draft == "same":
                assert usage.num_accepted_tokens == usage.num_drafted_tokens > 0
