"""Builds and loads the int4 x int8 kernel (`int4_kernel.c`: AVX2, and AVX-512 VNNI where the CPU has it) with the
system C compiler, once per source version.

The shared library lands in `<cache dir>/kernels/int4-<hash>.so` ($SPECMESH_CACHE_DIR or ~/.cache/specmesh) and is
called through ctypes, which releases the GIL during the call. With more than one torch thread the output tiles
are split across the kernel's own small thread pool; each output element is computed the same way whatever the
split (see the C file).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_kernel.c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-fno-fast-math", "-std=c11")
GROUP = 32          # inputs per scale and minimum
LANES = 8           # output channels per tile

_P = ctypes.c_void_p
_I = ctypes.c_int64


class KernelUnavailable(RuntimeError):
    """No C compiler, or a CPU without AVX2/FMA/F16C."""


def _cache_dir() -> Path:
    root = os.environ.get("SPECMESH_CACHE_DIR") or str(Path.home() / ".cache" / "specmesh")
    return Path(root) / "kernels"


def _compile(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise KernelUnavailable("dtype int4 needs a C compiler (gcc or $CC) to build its kernel once")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:        # build beside, then rename: atomic
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelUnavailable(f"building the int4 kernel failed: {proc.stderr.strip()[-2000:]}")
        os.replace(out, target)
    log.info("built the int4 kernel: %s", target)


def library_path() -> Path:
    """The shared library for this source and these flags, compiled first if missing."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    path = _cache_dir() / f"int4-{digest}.so"
    if not path.is_file():
        _compile(path)
    return path


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded kernel, built on first use. Raises KernelUnavailable with the reason."""
    lib = ctypes.CDLL(str(library_path()))
    lib.sm_cpu_supported.restype = ctypes.c_int
    if not lib.sm_cpu_supported():
        raise KernelUnavailable("dtype int4 needs a CPU with AVX2, FMA and F16C")
    lib.sm_quantize_rows.argtypes = [_P, _I, _I, _P, _P, _P]
    lib.sm_quantize_rows.restype = None
    lib.sm_int4_matmul.argtypes = [_P, _P, _P, _I, _I, _P, _P, _P, _P, _I, _I, _I, _P]
    lib.sm_int4_matmul.restype = None
    lib.sm_int4_matmul_mt.argtypes = [_P, _P, _P, _I, _I, _P, _P, _P, _P, _I, _I, _I, _P, ctypes.c_int]
    lib.sm_int4_matmul_mt.restype = None
    lib.sm_set_isa.argtypes = [ctypes.c_int]
    lib.sm_set_isa.restype = ctypes.c_int
    return lib


ISAS = ("avx2", "avx512vnni")      # the kernel's code paths, by the C file's ISA_* numbers


def instruction_set(wanted: str | None = None) -> str:
    """The kernel's code path in use (the best the CPU has, unless pinned); `wanted` pins one if the CPU has it.
    Both paths give bit-identical outputs."""
    return ISAS[library().sm_set_isa(ISAS.index(wanted) if wanted else -1)]


if __name__ == "__main__":          # build ahead of time (e.g. in an image that will have no compiler)
    print(library_path())
