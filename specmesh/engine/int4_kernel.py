"""Loads the int4 x int8 kernel (`int4_kernel.c`: AVX2, AVX-512 VNNI where the CPU has it, AMX for calls of many rows
where the CPU and the OS allow it), built once by
`cpu_build` into `<cache dir>/kernels/int4-<hash>.so`. With more than one torch thread the output tiles
are split across the kernel's own small thread pool; each output element is computed the same way whatever the
split (see the C file).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from specmesh.engine.cpu_build import KernelUnavailable, load

SOURCE = Path(__file__).with_name("int4_kernel.c")
GROUP = 32          # inputs per scale and minimum
LANES = 8           # output channels per tile

_P = ctypes.c_void_p
_I = ctypes.c_int64

__all__ = ["GROUP", "ISAS", "LANES", "KernelUnavailable", "instruction_set", "library"]


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded kernel, built on first use. Raises KernelUnavailable with the reason."""
    return declare(load(SOURCE))


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (this kernel, or a build of another revision of its source: bench/int4_prefetch.py) with the argument
    and result types of the functions callers use."""
    lib.sm_int4_linear.argtypes = [_P, _I, _I, _P, _P, _P, _P, _I, _P, ctypes.c_int]
    lib.sm_int4_linear.restype = None
    lib.sm_set_isa.argtypes = [ctypes.c_int]
    lib.sm_set_isa.restype = ctypes.c_int
    lib.sm_set_small_calls.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.sm_set_small_calls.restype = ctypes.c_int
    return lib


ISAS = ("avx2", "avx512vnni", "amx")      # the kernel's code paths, by the C file's ISA_* numbers


def instruction_set(wanted: str | None = None) -> str:
    """The kernel's code path in use (the best the CPU has, unless pinned); `wanted` pins one if the CPU has it, for
    calls of every size (int4_small_calls.py's choice for decode-sized ones is cleared). Every path gives
    bit-identical outputs ("amx" runs calls of few rows on the VNNI path)."""
    if wanted:                     # a pinned path runs every call (no calibrated path for small ones)
        library().sm_set_small_calls(-1, 0)
    return ISAS[library().sm_set_isa(ISAS.index(wanted) if wanted else -1)]


def set_small_calls(isa: str | None, max_rows: int) -> str | None:
    """Calls of at most `max_rows` rows run on the `isa` path (None or 0 rows: the chosen path for every call); a
    path above the chosen one is refused (None returned). Outputs are the same bits either way."""
    got = library().sm_set_small_calls(ISAS.index(isa) if isa else -1, max_rows)
    return ISAS[got] if got >= 0 else None
