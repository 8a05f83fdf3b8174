"""Model loading for the specmesh services: presets, Hugging Face dirs, GGUF files."""

from specmesh.models.loader import (
    CACHE_DIR_ENV,
    PRESETS,
    REAL_PRESETS,
    LoadedModel,
    collect_eos_token_ids,
    default_cache_dir,
    load_model,
    resolve_model_dir,
)
from specmesh.models.real_pair import (
    DRAFT_PRESET,
    FETCH_COMMAND,
    TARGET_PRESET,
    ChecksumError,
    assemble_gguf,
    fetch_model,
    fetch_real_pair,
)
from specmesh.models.tiny import (
    TINY_DRAFT,
    TINY_DRAFT_UNRELATED,
    TINY_PRESETS,
    TINY_TARGET,
    build_tiny_models,
    train_tokenizer,
)

__all__ = [
    "CACHE_DIR_ENV",
    "DRAFT_PRESET",
    "FETCH_COMMAND",
    "PRESETS",
    "REAL_PRESETS",
    "TARGET_PRESET",
    "TINY_DRAFT",
    "TINY_DRAFT_UNRELATED",
    "TINY_PRESETS",
    "TINY_TARGET",
    "ChecksumError",
    "LoadedModel",
    "assemble_gguf",
    "build_tiny_models",
    "collect_eos_token_ids",
    "default_cache_dir",
    "fetch_model",
    "fetch_real_pair",
    "load_model",
    "resolve_model_dir",
    "train_tokenizer",
]
