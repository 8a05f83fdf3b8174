"""Weights and KV in memory advised for huge pages (specmesh/engine/huge_pages.py): the same bytes, aligned views of
one mapping, the advice given where the host honours it, and a model's outputs unchanged by the move."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from specmesh.engine.huge_pages import ALIGN, huge_page_copies, huge_page_zeros, thp_mode
from specmesh.engine.int4_linear import WEIGHT_NAMES, Int4GroupLinear, int4_weights_to_huge_pages
from specmesh.engine.paged_attention import PagedKVCache

ADVICE_HONOURED = thp_mode() in ("always", "madvise") and Path("/proc/self/smaps").exists()


def vma_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:           # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_copies_hold_the_same_values_in_aligned_views_of_one_mapping() -> None:
    sources = [torch.randn(3, 5), torch.arange(7, dtype=torch.uint8), torch.randn(4, 9).half().t(),
               torch.zeros(0), torch.tensor([1.5], dtype=torch.float64)]
    copies = huge_page_copies(sources)
    for source, copy in zip(sources, copies, strict=True):
        assert torch.equal(copy, source) and copy.dtype == source.dtype and copy.is_contiguous()
        assert copy.numel() == 0 or copy.data_ptr() % ALIGN == 0
    storage = {c.untyped_storage().data_ptr() for c in copies}
    assert len(storage) == 1                                    # one mapping for the lot
    sources[0].fill_(7.0)
    assert not torch.equal(copies[0], sources[0])              # copies, not views of the sources


def test_zeros_are_zero_writable_and_disjoint() -> None:
    a, b = huge_page_zeros([(2, 3, 4), (5,)], torch.float32)
    assert a.shape == (2, 3, 4) and b.shape == (5,) and not a.any() and not b.any()
    a.fill_(1.0)
    assert not b.any()


def test_touched_zeros_are_resident_at_once() -> None:
    """A KV pool is backed when it is made, not page by page as a long prompt first writes its blocks."""
    def resident(t: torch.Tensor) -> int:
        """Pages of `t` backed by memory (/proc/self/pagemap's present bit)."""
        page = mmap.PAGESIZE
        start = t.data_ptr() // page * page
        length = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // page) * page
        with open(f"/proc/{os.getpid()}/pagemap", "rb") as pagemap:
            pagemap.seek(start // page * 8)
            entries = pagemap.read(length // page * 8)
        return sum(1 for i in range(0, len(entries), 8) if int.from_bytes(entries[i:i + 8], "little") >> 63)

    if not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists("/proc/self/pagemap"):
        pytest.skip("needs Linux")
    fresh = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # what the pool is made from
    lazy = torch.frombuffer(fresh, dtype=torch.uint8)
    touched, = huge_page_zeros([(4 << 20,)], torch.uint8)
    assert resident(lazy) == 0
    assert resident(touched) == (4 << 20) // mmap.PAGESIZE
    assert not touched.any()


def test_the_views_outlive_every_other_reference() -> None:
    copy = huge_page_copies([torch.arange(1 << 20, dtype=torch.int32)])[0]
    torch.randn(1 << 20)                                         # allocations after the helper returned
    assert int(copy[-1]) == (1 << 20) - 1


@pytest.mark.skipif(not ADVICE_HONOURED, reason="this host ignores MADV_HUGEPAGE (THP never, or not Linux)")
def test_the_mapping_is_advised_for_huge_pages() -> None:
    copy = huge_page_copies([torch.randn(1 << 20)])[0]
    fields = vma_flags(copy.data_ptr())
    assert "hg" in fields.get("VmFlags", "").split()             # hg: the mapping carries MADV_HUGEPAGE
    kv = PagedKVCache(2, 8, 16, 2, 8, torch.float32)
    assert "hg" in vma_flags(kv.key_caches[1].data_ptr()).get("VmFlags", "").split()


def test_int4_weights_move_and_the_outputs_keep_their_bits() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 40, bias=False))
    model[0], model[2] = Int4GroupLinear(model[0]), Int4GroupLinear(model[2])
    x = torch.randn(5, 64)
    before = model(x)
    old = {(i, name): getattr(model[i], name) for i in (0, 2) for name in WEIGHT_NAMES
           if getattr(model[i], name) is not None}
    moved = int4_weights_to_huge_pages(model)
    assert moved == sum(t.numel() * t.element_size() for t in old.values())
    for (i, name), tensor in old.items():
        now = getattr(model[i], name)
        assert torch.equal(now, tensor) and now.data_ptr() != tensor.data_ptr()
    assert torch.equal(model(x), before)
