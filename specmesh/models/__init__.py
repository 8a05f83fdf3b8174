"""Model loading for the specmesh services: presets, Hugging Face dirs, GGUF files.

Names are imported lazily (PEP 562), so `specmesh.models.catalog` and the CLI do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_SOURCES: dict[str, str] = {
    **dict.fromkeys(("PRESETS", "REAL_PRESETS", "LoadedModel", "collect_eos_token_ids", "load_model",
                     "resolve_model_dir"), "loader"),
    **dict.fromkeys(("DRAFT_PRESET", "FETCH_COMMAND", "TARGET_PRESET", "ChecksumError", "assemble_gguf",
                     "fetch_model", "fetch_real_pair"), "real_pair"),
    **dict.fromkeys(("TINY_DRAFT", "TINY_DRAFT_UNRELATED", "TINY_PRESETS", "TINY_TARGET", "build_tiny_models",
                     "train_tokenizer"), "tiny"),
    **dict.fromkeys(("ModelRefError", "PresetStatus", "check_model_ref", "preset_status"), "catalog"),
}

__all__ = sorted(_SOURCES)


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_SOURCES[name]}"), name)
    globals()[name] = value
    return value
