"""Loads the batch-invariant paged attention kernel (`attention_kernel.c`), built once by `cpu_build`.

`paged_attention_forward` uses it in rowwise mode (int8 and int4 models) when the queries are float32, the cache
float32 or float16 (`EngineConfig.kv_cache_dtype`; half values are converted to float as they are read) and the head
size is a multiple of 8; otherwise, or where it cannot be built, attention falls back to per-row SDPA. Rows
that share a key list (a chain's new tokens) run in tiles that read each key block once for all of them; tiles (and
a short batch's KV heads) are split over the kernel's own thread pool (`cpu_pool.h`), as many threads as the
step's budget (kernel_threads.py); every output is computed the same way whatever the split. Where the CPU has
AVX-512 the kernel runs in 512-bit registers, lane for lane the instructions of its AVX2 code (`code_path`).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import torch

from specmesh.engine.cpu_build import load_optional
from specmesh.engine.kernel_threads import num_kernel_threads

SOURCE = Path(__file__).with_name("attention_kernel.c")
_P = ctypes.c_void_p
_I = ctypes.c_int64


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (logged once) where it cannot be built or run."""
    lib = load_optional(SOURCE, "using per-row SDPA")
    if lib is None:
        return None
    lib.sm_paged_attention.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_float, _P, _P, ctypes.c_int,
                                       ctypes.c_int]
    lib.sm_paged_attention.restype = None
    lib.sm_row_tile.restype = ctypes.c_int
    lib.sm_attention_wide.argtypes = [ctypes.c_int]
    lib.sm_attention_wide.restype = ctypes.c_int
    return lib


CODE_PATHS = ("avx2", "avx512")      # 256-bit and 512-bit registers: the same bits (attention_kernel.c)


def code_path(wanted: str | None = None) -> str:
    """The kernel's code path in use ("avx512" where the CPU has AVX-512F/DQ, unless pinned); `wanted` pins one if
    the CPU has it. Both give bit-identical outputs."""
    lib = library()
    assert lib is not None, "check supports() first"
    return CODE_PATHS[lib.sm_attention_wide(CODE_PATHS.index(wanted) if wanted else -1)]


@functools.cache
def row_tile() -> int:
    """Rows the kernel runs together over one key list (its ROW_TILE): a thread's scratch holds one tile's."""
    lib = library()
    assert lib is not None, "check supports() first"
    return int(lib.sm_row_tile())


class _Scratch(threading.local):
    buffer: torch.Tensor | None = None


_scratch = _Scratch()


def scratch(num_floats: int) -> torch.Tensor:
    """This thread's kernel scratch of at least `num_floats` floats, kept between calls (a forward calls the kernel
    once a layer; a fresh multi-MB buffer each time would fault its pages in again)."""
    buffer = _scratch.buffer
    if buffer is None or buffer.numel() < num_floats:
        buffer = _scratch.buffer = torch.empty(num_floats, dtype=torch.float32)
    return buffer


CACHE_DTYPES = (torch.float32, torch.float16)   # the cache element types the kernel reads (half: converted on load)


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel runs a cache of `dtype` with this head size (queries are float32 either way)."""
    return dtype in CACHE_DTYPES and head_dim % 8 == 0 and library() is not None


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, key_slots: torch.Tensor,
                    row_start: torch.Tensor, row_len: torch.Tensor, max_len: int, scale: float,
                    threads: int | None = None) -> torch.Tensor:
    """query [T, H, D] float32; key_cache, value_cache [num_slots, kvH, D] float32 or float16 (a layer's pool, viewed
    flat by slot; a half cache's keys and values are converted to float32 as they are read);
    row t attends to key_slots[row_start[t] : row_start[t] + row_len[t]] (int32 slot ids, in key order).
    Runs on `threads` threads (default: the step's kernel threads, kernel_threads.py); the numbers do not depend on
    it. Returns [T, H, D]."""
    lib = library()
    assert lib is not None, "check supports() first"
    assert key_cache.dtype == value_cache.dtype and key_cache.dtype in CACHE_DTYPES, key_cache.dtype
    rows, heads, head_dim = query.shape
    threads = max(1, num_kernel_threads() if threads is None else threads)
    query = query.contiguous()
    out = torch.empty_like(query)
    work = scratch(threads * row_tile() * heads * (max(1, max_len) + 1))   # per thread: a tile's probs, inv
    lib.sm_paged_attention(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), key_slots.data_ptr(),
                           row_start.data_ptr(), row_len.data_ptr(), rows, heads, key_cache.shape[1], head_dim,
                           scale, work.data_ptr(), out.data_ptr(), threads, int(key_cache.dtype == torch.float16))
    return out
