"""Tensors in memory advised for transparent huge pages (2 MiB pages instead of 4 KiB ones).

Why: a CPU decode step streams every weight once per token (and a long context's KV once per layer). Over 4 KiB
pages a 1 GB int4 model crosses ~250,000 pages a token, each a TLB miss, and the hardware prefetcher stops at every
page boundary. With 2 MiB pages that is ~500. `python -m bench.huge_pages` times both; the README's "Huge pages"
has what it measured (within noise of nothing on a 2-core Zen 5).

Linux only. The host's setting decides: `/sys/kernel/mm/transparent_hugepage/enabled` "madvise" (Debian and Ubuntu's
default) or "always" honour the advice, "never" ignores it. Either way the tensors hold the same bytes, so the
numbers never change; only where the memory comes from does.

How: one anonymous mapping for a group of tensors, aligned to 2 MiB and advised MADV_HUGEPAGE before any page is
touched, so first-touch faults take whole huge pages; each tensor is a view at a 64-byte aligned offset, in the
order given (a forward's order streams the mapping front to back). The mapping lives as long as any of its views.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20            # x86-64's PMD page
ALIGN = 64                     # a cache line: every view starts on one (the kernels load aligned vectors)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The host's transparent huge page mode ("always", "madvise", "never"), "" where there is none (not Linux)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return ""
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else ""


def huge_page_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of `tensors`, back to back in one mapping advised for huge pages (plain copies where the
    advice cannot be given)."""
    spans = _arena([t.numel() * t.element_size() for t in tensors])
    if spans is None:
        return [t.contiguous().clone() for t in tensors]
    return [span.view(t.dtype).view(t.shape).copy_(t) for span, t in zip(spans, tensors, strict=True)]


def huge_page_zeros(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zero tensors of `shapes`, back to back in one mapping advised for huge pages, every page backed now (one write
    a page): a fresh mapping reads as zeros but is backed as its pages are first written, and then a write waits for
    the kernel to find, zero (and, with THP defrag "madvise", compact memory for) a 2 MiB page."""
    element = torch.empty((), dtype=dtype).element_size()
    spans = _arena([element * math.prod(shape) for shape in shapes])
    if spans is None:
        return [torch.zeros(shape, dtype=dtype) for shape in shapes]
    for span in spans:
        span[::mmap.PAGESIZE].zero_()
    return [span.view(dtype).view(shape) for span, shape in zip(spans, shapes, strict=True)]


def _arena(sizes: Sequence[int]) -> list[torch.Tensor] | None:
    """uint8 spans of `sizes` bytes in one fresh mapping whose huge-page-aligned part is advised MADV_HUGEPAGE;
    None where Python cannot give the advice (not Linux) or there is nothing to hold."""
    total = sum(_aligned(size) for size in sizes)
    if total == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    # private: a shared anonymous mapping is shmem, whose huge pages follow another setting (shmem_enabled)
    arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # zero-filled, unbacked
    whole = torch.frombuffer(arena, dtype=torch.uint8)     # holds `arena` as long as any view of it lives
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        arena.madvise(mmap.MADV_HUGEPAGE, start, _aligned(total, mmap.PAGESIZE))
    except OSError as exc:           # a kernel built without THP: plain pages, the same bytes
        log.debug("MADV_HUGEPAGE refused (%s): plain pages", exc)
    spans, offset = [], start
    for size in sizes:
        spans.append(whole[offset:offset + size])
        offset += _aligned(size)
    return spans


def _aligned(size: int, to: int = ALIGN) -> int:
    return -(-size // to) * to
