"""Builds a model engine's parts from an `EngineConfig` (shared by the verifier and the draft service)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specmesh.config import EngineConfig
from specmesh.engine import attention_kernel
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.dtype_choice import resolve_dtype
from specmesh.engine.huge_pages import thp_mode
from specmesh.engine.int4_linear import int4_weights_to_huge_pages, quantize_linears_int4
from specmesh.engine.int4_small_calls import calibrate_small_calls
from specmesh.engine.int8_linear import quantize_linears
from specmesh.engine.model_runner import ModelRunner, kv_cache_geometry
from specmesh.engine.paged_attention import PagedKVCache
from specmesh.engine.qwen2_decoder import fuse_projections
from specmesh.engine.step_budget import check_step_budget
from specmesh.engine.vocab_head import restrict_lm_head
from specmesh.models import LoadedModel, load_model

log = logging.getLogger(__name__)

# "int8": float32 weights quantized to int8 with per-token activation scales (batch-invariant, see int8_linear).
# "int4": 4-bit weights in groups of 32, int8 per-token activations (batch-invariant, see int4_linear).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.float32,
          "int4": torch.float32}
# KV cache elements (`EngineConfig.kv_cache_dtype`): float16 halves the pool's bytes per token, rounding each key and
# value to half precision when written (attention reads them back as floats, attention_kernel.c); "auto" = float16
# for the int8 / int4 models where the attention kernel runs (as llama.cpp's default f16 cache), else the model's
# compute dtype (DTYPES)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "float32": torch.float32, "float16": torch.float16}
FORWARDS = ("specmesh", "transformers")     # the model forward: specmesh's own (qwen2_decoder) where it applies
QUANTIZERS = {"int8": (quantize_linears, "int8 (per-token activations)"),
              "int4": (quantize_linears_int4, "int4 groups of 32 (per-token int8 activations)")}


@dataclass(frozen=True)
class EngineParts:
    loaded: LoadedModel
    runner: ModelRunner
    block_manager: BlockManager
    max_model_len: int


def resolve_kv_cache_dtype(config: EngineConfig, head_dim: int) -> torch.dtype:
    """The KV cache's element type: the one asked for, or for "auto" float16 where the model's numerics are int8 /
    int4 and the attention kernel reads half caches for this head size, else the model's compute dtype."""
    asked = KV_CACHE_DTYPES[config.kv_cache_dtype]
    if asked is not None:
        return asked
    if config.dtype in QUANTIZERS and attention_kernel.supports(head_dim, torch.float16):
        return torch.float16
    return DTYPES[config.dtype]


def build_engine_parts(config: EngineConfig, head_vocab: int = 0) -> EngineParts:
    """head_vocab > 0 (draft models only): restrict the LM head to that many token ids (see vocab_head).
    dtype "auto" becomes the fastest batch-invariant numerics this CPU runs (dtype_choice), logged with why."""
    choice = resolve_dtype(config.dtype, config.model)
    log.info("%s", choice.describe(config.model))
    config = dataclasses.replace(config, dtype=choice.dtype)
    if config.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {config.kv_cache_dtype!r}")
    if config.forward not in FORWARDS:
        raise ValueError(f"forward must be one of {list(FORWARDS)}, got {config.forward!r}")
    check_step_budget(config.step_cost_factor, config.min_prefill_tokens)
    torch.set_num_threads(config.num_threads)
    cache_dir = Path(config.cache_dir) if config.cache_dir else None
    loaded = load_model(config.model, dtype=DTYPES[config.dtype], cache_dir=cache_dir)
    num_layers, num_kv_heads, head_dim = kv_cache_geometry(loaded.model)
    kv_dtype = resolve_kv_cache_dtype(config, head_dim)
    per_block = PagedKVCache.bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim, kv_dtype)
    num_blocks = config.num_kv_blocks or config.kv_cache_memory_mb * 2**20 // per_block
    if num_blocks < 2:
        raise ValueError(f"kv_cache_memory_mb={config.kv_cache_memory_mb} holds {num_blocks} blocks of "
                         f"{per_block} bytes; raise it")
    max_model_len = loaded.max_model_len
    if config.max_model_len:
        max_model_len = min(max_model_len, config.max_model_len)
    log.info("%s: %d KV blocks x %d tokens (%d MiB, %s), max_model_len %d", config.model, num_blocks,
             config.block_size, num_blocks * per_block // 2**20, str(kv_dtype).removeprefix("torch."), max_model_len)
    if head_vocab > 0:
        tok = loaded.tokenizer
        always = [*tok.all_special_ids, *tok.get_added_vocab().values(), *loaded.eos_token_ids]
        log.info("%s: LM head restricted to %d token ids", config.model,
                 restrict_lm_head(loaded.model, head_vocab, always))
    own_forward = config.forward == "specmesh" and fuse_projections(loaded.model)
    if own_forward:
        log.info("%s: q/k/v and gate/up projections fused (specmesh's Qwen2 forward)", config.model)
    batch_invariant = config.dtype in QUANTIZERS
    if batch_invariant:
        quantize, what = QUANTIZERS[config.dtype]
        log.info("%s: %d linear layers quantized to %s", config.model, quantize(loaded.model), what)
    if config.dtype == "int4":
        moved = int4_weights_to_huge_pages(loaded.model)
        log.info("%s: %d MiB of int4 weights in memory advised for huge pages (this host's THP mode: %s)",
                 config.model, moved // 2**20, thp_mode() or "none")
        log.info("%s: %s", config.model,
                 calibrate_small_calls(loaded.model, max(config.num_threads, config.num_threads_max)))
    runner = ModelRunner(loaded.model, num_blocks, config.block_size, kv_dtype=kv_dtype,
                         batch_invariant=batch_invariant, own_forward=own_forward)
    return EngineParts(loaded, runner, BlockManager(num_blocks, config.block_size), max_model_len)
