"""specmesh's own Qwen2 forward (`qwen2_decoder`): the same logits as transformers' forward over the same paged cache,
fused projections bit-identical to separate ones under int8 / int4, and the rope kernel equal to transformers'
`apply_rotary_pos_emb` bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from specmesh.config import EngineConfig
from specmesh.engine import qwen2_decoder
from specmesh.engine.build import QUANTIZERS, build_engine_parts
from specmesh.engine.model_runner import ForwardItem, ModelRunner
from specmesh.engine.paged_attention import PagedKVCache
from specmesh.models import resolve_model_dir

BLOCK = 4
TABLE = list(range(40))


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("tiny-target")), dtype=torch.float32)


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a 33-token prefill (all rows), a 5-token chain verify, a tree of 4 nodes and a 1-token decode."""
    ids = _ids(45)
    out = [runner.forward([ForwardItem(ids[:33], 0, TABLE, 33)])[0],
           runner.forward([ForwardItem(ids[33:38], 33, TABLE, 5)])[0],
           runner.forward([ForwardItem(ids[38:43], 38, TABLE, 5, tree_parents=[-1, -1, 0, 1])])[0],
           runner.forward([ForwardItem(ids[43:44], 38, TABLE, 1)])[0]]
    return out


def test_the_runner_uses_its_own_forward_for_qwen2(target: torch.nn.Module) -> None:
    assert qwen2_decoder.supports(target)
    assert ModelRunner(copy.deepcopy(target), len(TABLE), BLOCK).decoder is not None


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_logits_match_transformers_forward(target: torch.nn.Module, batch_invariant: bool) -> None:
    ours = ModelRunner(copy.deepcopy(target), len(TABLE), BLOCK, batch_invariant=batch_invariant)
    theirs = ModelRunner(copy.deepcopy(target), len(TABLE), BLOCK, batch_invariant=batch_invariant)
    theirs.decoder = None                                   # transformers' forward with the paged attention
    for a, b in zip(_steps(ours), _steps(theirs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)     # RMSNorm sums in another order
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # the caches hold the same keys and values (the rope kernel wrote them; transformers' path wrote its own)
    for mine, other in zip(ours.cache.key_caches, theirs.cache.key_caches, strict=True):
        torch.testing.assert_close(mine, other, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_fused_projections_are_bit_identical(target: torch.nn.Module, dtype: str) -> None:
    fused_model, separate_model = copy.deepcopy(target), copy.deepcopy(target)
    assert qwen2_decoder.fuse_projections(fused_model)
    assert not hasattr(fused_model.model.layers[0].self_attn, "q_proj")
    for model in (fused_model, separate_model):
        QUANTIZERS[dtype][0](model)
    fused = ModelRunner(fused_model, len(TABLE), BLOCK, batch_invariant=True)
    separate = ModelRunner(separate_model, len(TABLE), BLOCK, batch_invariant=True)
    for a, b in zip(_steps(fused), _steps(separate), strict=True):
        assert torch.equal(a, b)


def test_a_model_it_cannot_run_keeps_transformers_forward(target: torch.nn.Module) -> None:
    half = copy.deepcopy(target).to(torch.bfloat16)
    assert not qwen2_decoder.supports(half) and not qwen2_decoder.fuse_projections(half)
    assert ModelRunner(half, len(TABLE), BLOCK).decoder is None


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_rope_kernel_equals_transformers_rotary(target: torch.nn.Module, kv_dtype: torch.dtype) -> None:
    """Queries bit for bit; the stored keys and values bit for bit too, in a half cache as torch rounds them
    (`.to(torch.float16)`, what the transformers forward's cache write does)."""
    cfg = target.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    rows = 7
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    positions = torch.tensor([0, 1, 2, 17, 300, 4095, 9])
    slots = torch.tensor([5, 0, 9, 3, 11, 2, 7])
    cache = PagedKVCache(1, 4, BLOCK, kv_heads, head_dim, kv_dtype)
    decoder = qwen2_decoder.Qwen2Decoder(target)
    cos, sin = decoder.rope.rows(positions, int(positions.max()))
    query = torch.empty(rows, heads, head_dim)
    decoder.lib.sm_rope_store(qkv.data_ptr(), rows, heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                              slots.data_ptr(), cache.key_caches[0].data_ptr(), cache.value_caches[0].data_ptr(),
                              query.data_ptr(), int(kv_dtype == torch.float16))
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    full_cos, full_sin = target.model.rotary_emb(qkv, positions.unsqueeze(0))        # [1, rows, D]
    q_ref, k_ref = apply_rotary_pos_emb(q.view(1, rows, heads, head_dim).transpose(1, 2),
                                        k.view(1, rows, kv_heads, head_dim).transpose(1, 2), full_cos, full_sin)
    assert torch.equal(query, q_ref[0].transpose(0, 1))
    flat_keys = cache.key_caches[0].view(-1, kv_heads, head_dim)
    flat_values = cache.value_caches[0].view(-1, kv_heads, head_dim)
    assert torch.equal(flat_keys[slots], k_ref[0].transpose(0, 1).to(kv_dtype))
    assert torch.equal(flat_values[slots], v.view(rows, kv_heads, head_dim).to(kv_dtype))


@pytest.mark.parametrize("dtype", ["int4", "float32"])
def test_a_half_kv_cache_runs_on_both_forwards_alike(target: torch.nn.Module, dtype: str) -> None:
    """kv_cache_dtype float16: specmesh's forward (rope kernel writing half floats, the attention kernel reading them
    in rowwise mode) and transformers' (torch's cache write, the same attention) give the same logits; the float32
    model's are close to a float32 cache's (half-precision keys and values; int4's per-token activation scales can
    move a rounding step further, so there only the two forwards are compared)."""
    def runner(kv_dtype: torch.dtype, own: bool) -> ModelRunner:
        model = copy.deepcopy(target)
        if dtype != "float32":
            QUANTIZERS[dtype][0](model)
        r = ModelRunner(model, len(TABLE), BLOCK, kv_dtype=kv_dtype, batch_invariant=dtype != "float32")
        if not own:
            r.decoder = None
        return r
    ours, theirs, full = runner(torch.float16, True), runner(torch.float16, False), runner(torch.float32, True)
    assert ours.decoder is not None and ours.cache.key_caches[0].dtype == torch.float16
    for a, b, c in zip(_steps(ours), _steps(theirs), _steps(full), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)     # RMSNorm sums in another order
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        if dtype == "float32":
            torch.testing.assert_close(a, c, rtol=0.0, atol=0.05)  # rounded keys and values: close, not equal
    for mine, other in zip(ours.cache.key_caches, theirs.cache.key_caches, strict=True):
        torch.testing.assert_close(mine.float(), other.float(), rtol=2e-3, atol=1e-3)


def test_engine_config_picks_the_forward() -> None:
    own = build_engine_parts(EngineConfig(model="tiny-target", dtype="int4", num_kv_blocks=8))
    theirs = build_engine_parts(EngineConfig(model="tiny-target", dtype="int4", num_kv_blocks=8,
                                             forward="transformers"))
    assert own.runner.decoder is not None and qwen2_decoder.is_fused(own.runner.model)
    assert theirs.runner.decoder is None and not qwen2_decoder.is_fused(theirs.runner.model)
    ids = _ids(9)
    a, b = (parts.runner.forward([ForwardItem(ids, 0, [0, 1, 2], 9)])[0] for parts in (own, theirs))
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="forward must be one of"):
        build_engine_parts(EngineConfig(model="tiny-target", forward="jax"))


def test_a_half_kv_cache_holds_twice_the_tokens_in_the_same_budget() -> None:
    """kv_cache_dtype: "auto" is float16 for a quantized model (the kernel's rowwise path), the model's float32
    otherwise; a half cache holds twice the blocks of a float one in the same budget; anything else is an error."""
    full = build_engine_parts(EngineConfig(model="tiny-target", dtype="int4", kv_cache_memory_mb=1,
                                           kv_cache_dtype="float32"))
    half = build_engine_parts(EngineConfig(model="tiny-target", dtype="int4", kv_cache_memory_mb=1))   # auto
    assert half.block_manager.num_blocks == 2 * full.block_manager.num_blocks
    assert half.runner.cache.key_caches[0].dtype == torch.float16 and half.runner.decoder is not None
    assert full.runner.cache.key_caches[0].dtype == torch.float32
    floats = build_engine_parts(EngineConfig(model="tiny-target", dtype="float32", kv_cache_memory_mb=1))   # auto
    assert floats.runner.cache.key_caches[0].dtype == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        build_engine_parts(EngineConfig(model="tiny-target", kv_cache_dtype="fp8"))
