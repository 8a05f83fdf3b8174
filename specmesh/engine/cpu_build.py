"""Builds a C kernel source with the system compiler into a shared library, once per source version and flags.

Libraries land in `<cache dir>/kernels/<name>-<hash>.so` ($SPECMESH_CACHE_DIR or ~/.cache/specmesh), built beside
and renamed (atomic, so concurrent services never load a half-written file), and are called through ctypes, which
releases the GIL during each call. `python -m specmesh.engine.cpu_build` builds every kernel ahead of time (e.g. in
an image that will have no compiler).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from specmesh.config import c_compiler_setting, cache_dir_setting

log = logging.getLogger(__name__)

# _GNU_SOURCE: cpu_pool.h keeps its workers off the caller's core (sched_getcpu, sched_setaffinity)
AVX2_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-fno-fast-math", "-std=c11", "-D_GNU_SOURCE")


class KernelUnavailable(RuntimeError):
    """No C compiler, a failed build, or a CPU without the instructions a kernel needs."""


def _cache_dir() -> Path:
    root = cache_dir_setting() or str(Path.home() / ".cache" / "specmesh")
    return Path(root) / "kernels"


def _compile(source: Path, cflags: tuple[str, ...], target: Path) -> None:
    compiler = c_compiler_setting() or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise KernelUnavailable(f"{source.name} needs a C compiler (gcc or $CC) to be built once")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:        # build beside, then rename: atomic
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *cflags, str(source), "-o", str(out), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelUnavailable(f"building {source.name} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(out, target)
    log.info("built %s: %s", source.name, target)


def library_path(source: Path, cflags: tuple[str, ...] = AVX2_CFLAGS) -> Path:
    """The shared library for this source, the headers beside it and these flags, compiled first if missing."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))    # cpu_pool.h and the like
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(cflags).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{source.stem.removesuffix('_kernel')}-{digest}.so"
    if not path.is_file():
        _compile(source, cflags, path)
    return path


def load(source: Path, cflags: tuple[str, ...] = AVX2_CFLAGS) -> ctypes.CDLL:
    """The loaded library; every kernel source exports `sm_cpu_supported`, checked here. A library with a thread
    pool (cpu_pool.h) runs its jobs on the process's one shared pool (`share_pools`)."""
    lib = ctypes.CDLL(str(library_path(source, cflags)))
    lib.sm_cpu_supported.restype = ctypes.c_int
    if not lib.sm_cpu_supported():
        raise KernelUnavailable(f"{source.name} needs a CPU with AVX2, FMA and F16C")
    if hasattr(lib, "sm_use_pool"):
        lib.sm_use_pool.argtypes = [ctypes.c_void_p]
        lib.sm_use_pool.restype = None
        _pooled.append(lib)
        share_pools(_pools_shared)
    return lib


_pooled: list[ctypes.CDLL] = []      # libraries with a pool, in load order: the first one's pool is the shared one
_pools_shared = True


def share_pools(shared: bool = True) -> None:
    """Every pooled library runs its jobs on the first loaded one's workers (one spinning worker a core), or, with
    `shared` False, each on its own (cpu_pool.h says why one is better; bench.kernel_pool measures it)."""
    global _pools_shared
    _pools_shared = shared
    if not _pooled:
        return
    run = ctypes.cast(_pooled[0].sm_pool_run, ctypes.c_void_p).value if shared else None
    for lib in _pooled[1:]:
        lib.sm_use_pool(run)


def load_optional(source: Path, fallback: str) -> ctypes.CDLL | None:
    """`load(source)`, or None (logged once per caller, as a warning naming `fallback`) where it cannot be built or
    run: for kernels the engine can do without."""
    try:
        return load(source)
    except KernelUnavailable as err:
        log.warning("%s unavailable, %s: %s", source.name, fallback, err)
        return None


if __name__ == "__main__":
    for kernel in sorted(Path(__file__).parent.glob("*_kernel.c")):
        print(library_path(kernel))
