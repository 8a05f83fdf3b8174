"""The paged attention kernel (specmesh/engine/attention_kernel.c): exact against a float64 reference, bit-identical
for a row whatever shares the call or where its keys live, and the slot lists `RowKeys` builds for chains and trees."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine import attention_kernel
from specmesh.engine.paged_attention import RowKeys, SeqSlice

pytestmark = pytest.mark.skipif(not attention_kernel.supports(8, torch.float32), reason="no C compiler or AVX2")


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: list[list[int]],
              scale: float) -> torch.Tensor:
    """float64 softmax attention, row t over keys[slots[t]]; query [T, H, D], keys [S, kvH, D]."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    out = []
    for t, row_slots in enumerate(slots):
        k = keys[row_slots].double().repeat_interleave(heads // kv_heads, dim=1)     # [n, H, D]
        v = values[row_slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[t].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def run(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: list[list[int]],
        scale: float) -> torch.Tensor:
    flat = torch.tensor([s for row in slots for s in row], dtype=torch.int32)
    lengths = torch.tensor([len(row) for row in slots])
    starts = torch.cumsum(lengths, 0) - lengths
    return attention_kernel.paged_attention(query, keys, values, flat, starts, lengths, int(lengths.max()), scale)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 2, 128), (14, 2, 64), (4, 2, 16), (2, 2, 8)])
def test_kernel_matches_float64_attention(heads: int, kv_heads: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(heads)
    num_slots = 400
    keys = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    values = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    lengths = [1, 5, 8, 9, 100, 257]                   # vector tails of every kind, and a long row
    slots = [torch.randperm(num_slots, generator=g)[:n].tolist() for n in lengths]
    query = torch.randn(len(lengths), heads, head_dim, generator=g) * 3     # peaked softmaxes too
    out = run(query, keys, values, slots, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), reference(query, keys, values, slots, head_dim ** -0.5),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("length", [3, 8, 31, 32, 33, 77, 100])
def test_the_largest_score_counts_wherever_it_sits_in_the_row(length: int) -> None:
    """Scores ~100 apart: the softmax takes exp(s - max), so a maximum that missed the key with the largest score
    (first key, a vector tail, a 32-key block) would overflow to inf and NaN. Each row has it at another place."""
    keys, values = torch.zeros(length, 1, 8), torch.randn(length, 1, 8, generator=torch.Generator().manual_seed(1))
    keys[:, 0, 0] = -torch.arange(length, dtype=torch.float32)      # key j scores -100 j for query (100, 0, ...)
    slots = [[(j + shift) % length for j in range(length)] for shift in range(length)]   # the top key at every place
    query = torch.zeros(len(slots), 1, 8)
    query[:, 0, 0] = 100.0
    out = run(query, keys, values, slots, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(query, keys, values, slots, 1.0), rtol=1e-5, atol=1e-6)


def test_a_row_is_bit_identical_alone_in_a_batch_and_wherever_its_keys_are_stored() -> None:
    """What exact speculation needs: row 0 alone, beside other rows, and with its keys copied to other slots (a tree
    path's keys vs a chain's) gives the same bits."""
    g = torch.Generator().manual_seed(7)
    keys, values = torch.randn(300, 2, 128, generator=g), torch.randn(300, 2, 128, generator=g)
    query = torch.randn(5, 12, 128, generator=g)
    row = list(range(0, 90))
    others = [list(range(50, 50 + n)) for n in (3, 17, 64, 120)]
    alone = run(query[:1], keys, values, [row], 0.088)
    together = run(query, keys, values, [row, *others], 0.088)
    moved = list(range(150, 240))
    keys[moved], values[moved] = keys[row], values[row]
    elsewhere = run(query[:1], keys, values, [moved], 0.088)
    assert torch.equal(alone[0], together[0])
    assert torch.equal(alone, elsewhere)


def test_row_keys_for_a_chain_and_a_tree() -> None:
    """Plain-int slot lists: a chain's rows share one list (row i sees the context and new tokens 0..i); a tree row
    sees the context, then its ancestors and itself, by their slots."""
    block = 4
    chain = SeqSlice(query_start=0, query_len=3, context_len=7, block_table=[5, 2])   # 4 cached + 3 new
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)           # root, two children
    tree = SeqSlice(query_start=3, query_len=3, context_len=5, block_table=[9, 1], query_mask=mask)
    rk = RowKeys.build([chain, tree], block)
    chain_slots = [20, 21, 22, 23, 8, 9, 10]
    rows = [rk.key_slots[s:s + n].tolist() for s, n in zip(rk.row_start.tolist(), rk.row_len.tolist(), strict=True)]
    assert rows[:3] == [chain_slots[:5], chain_slots[:6], chain_slots]
    context = [36, 37]                                         # positions 0, 1 in block 9; new tokens at 38, 39, 4
    assert rows[3:] == [[*context, 38], [*context, 38, 39], [*context, 38, 4]]
    assert rk.max_len == 7


@pytest.mark.parametrize("num_rows", [1, 3, 40])        # one row split by KV head, a few rows split so, rows whole
def test_threads_change_nothing(num_rows: int) -> None:
    """Rows and KV heads run on the kernel's thread pool: any thread count gives the one-thread bits, and a row's bits
    do not depend on whether its KV heads were split (1 and 3 rows) or not (40 rows) across threads."""
    g = torch.Generator().manual_seed(num_rows)
    keys, values = torch.randn(600, 2, 128, generator=g), torch.randn(600, 2, 128, generator=g)
    query = torch.randn(num_rows, 12, 128, generator=g)
    slots = [torch.randperm(600, generator=g)[: 1 + 37 * t % 560].tolist() for t in range(num_rows)]
    flat = torch.tensor([s for row in slots for s in row], dtype=torch.int32)
    lengths = torch.tensor([len(row) for row in slots])
    starts = torch.cumsum(lengths, 0) - lengths
    outs = [attention_kernel.paged_attention(query, keys, values, flat, starts, lengths, int(lengths.max()), 0.088,
                                             threads=threads) for threads in (1, 2, 3, 8)]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    first_alone = attention_kernel.paged_attention(query[:1], keys, values, flat, starts[:1], lengths[:1],
                                                   int(lengths[0]), 0.088, threads=2)
    assert torch.equal(first_alone[0], outs[0][0])


@pytest.mark.parametrize("num_new", [1, 5, 8, 9, 20])     # tiles of 8 rows: one partial, one full, full + partial
def test_chain_rows_in_tiles_are_bit_identical_to_rows_alone(num_new: int) -> None:
    """A chain's new tokens share one key list (row i sees the context and new tokens 0..i) and run in tiles that read
    each key block once for the tile: every row's bits equal the row run alone over its own copy of its keys, and
    the float64 reference holds."""
    g = torch.Generator().manual_seed(num_new)
    keys, values = torch.randn(900, 2, 128, generator=g), torch.randn(900, 2, 128, generator=g)
    context = 777                                    # not a multiple of a key block: every row ends mid-block
    chain = torch.randperm(900, generator=g)[: context + num_new].to(torch.int32)
    query = torch.randn(num_new, 12, 128, generator=g) * 2
    lengths = torch.arange(context + 1, context + num_new + 1)
    for threads in (1, 2):
        tiled = attention_kernel.paged_attention(query, keys, values, chain, torch.zeros(num_new, dtype=torch.long),
                                                 lengths, int(lengths.max()), 0.088, threads=threads)
        rows = [chain[: int(n)].tolist() for n in lengths]
        alone = run(query, keys, values, rows, 0.088)         # a key list per row: no tiles
        assert torch.equal(tiled, alone)
    torch.testing.assert_close(tiled.double(), reference(query, keys, values, rows, 0.088), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 2, 128), (7, 1, 64), (4, 2, 24)])
def test_a_head_gets_the_bits_it_gets_over_its_own_kv_head(heads: int, kv_heads: int, head_dim: int) -> None:
    """The score pass reads a key once for a pair of query heads of its KV head (an odd head alone): each head's
    scores are still its own FMA chains, so rows of a grouped model equal, bit for bit, those of the same query heads
    each over its own copy of their KV head (every head alone), on each code path, in tiles and alone, any threads."""
    g = torch.Generator().manual_seed(heads * head_dim + kv_heads)
    keys, values = torch.randn(600, kv_heads, head_dim, generator=g), torch.randn(600, kv_heads, head_dim, generator=g)
    group = heads // kv_heads
    own_keys, own_values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    chain = torch.randperm(600, generator=g)[:530].to(torch.int32)
    lengths = torch.tensor([1, 9, 300, *range(515, 530)])
    query = torch.randn(len(lengths), heads, head_dim, generator=g) * 2

    def rows(k: torch.Tensor, v: torch.Tensor, threads: int) -> torch.Tensor:
        return attention_kernel.paged_attention(query, k, v, chain, torch.zeros(len(lengths), dtype=torch.long),
                                                lengths, 529, head_dim ** -0.5, threads=threads)

    initial = attention_kernel.code_path()
    paths = attention_kernel.CODE_PATHS if initial == "avx512" else ("avx2",)
    try:
        for path in paths:
            attention_kernel.code_path(path)
            for threads in (1, 2):
                assert torch.equal(rows(keys, values, threads), rows(own_keys, own_values, threads))
    finally:
        attention_kernel.code_path(initial)


@pytest.mark.skipif(attention_kernel.supports(8, torch.float32) and attention_kernel.code_path() != "avx512",
                    reason="the CPU has no AVX-512")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 2, 128), (14, 2, 64), (5, 1, 24), (3, 3, 8)])
def test_512_bit_code_gives_the_bits_of_the_256_bit_code(heads: int, kv_heads: int, head_dim: int) -> None:
    """Head pairs and odd heads out, value chunks of 32, 16 and 8 dims, rows in tiles and alone: the AVX-512 path is
    the AVX2 path lane for lane, so a verifier on either gives the same tokens."""
    g = torch.Generator().manual_seed(heads * head_dim)
    keys, values = torch.randn(700, kv_heads, head_dim, generator=g), torch.randn(700, kv_heads, head_dim, generator=g)
    chain = torch.randperm(700, generator=g)[:530].tolist()
    slots = [chain[:n] for n in (1, 7, 9, 300, 521, 522, 523, 524, 525)] + [chain[100:117]]
    query = torch.randn(len(slots), heads, head_dim, generator=g) * 2
    lengths = torch.arange(515, 530)                  # a chain's rows share its key list: tiles of 8 rows
    chain_query = torch.randn(len(lengths), heads, head_dim, generator=g)

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        tiled = attention_kernel.paged_attention(chain_query, keys, values, torch.tensor(chain, dtype=torch.int32),
                                                 torch.zeros(len(lengths), dtype=torch.long), lengths, 529,
                                                 head_dim ** -0.5, threads=2)
        return run(query, keys, values, slots, head_dim ** -0.5), tiled

    outs = {}
    try:
        for path in attention_kernel.CODE_PATHS:
            outs[attention_kernel.code_path(path)] = both()
    finally:
        attention_kernel.code_path("avx512")
    assert set(outs) == {"avx2", "avx512"}
    for narrow, wide in zip(outs["avx2"], outs["avx512"], strict=True):
        assert torch.equal(narrow, wide)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 2, 128), (14, 2, 64), (5, 1, 24), (3, 3, 8)])
def test_a_half_cache_gives_the_bits_of_its_values_in_a_float_cache(heads: int, kv_heads: int, head_dim: int) -> None:
    """kv_cache_dtype float16: every half float is a float, and the kernel converts each key and value as it reads it,
    so a row over a half cache has exactly the bits of the same row over a float32 cache holding those values, on
    either code path, any thread count, in tiles or alone; and it stays close to float64 attention over them."""
    g = torch.Generator().manual_seed(heads + head_dim)
    keys16 = (torch.randn(700, kv_heads, head_dim, generator=g) * 2).half()
    values16 = torch.randn(700, kv_heads, head_dim, generator=g).half()
    keys, values = keys16.float(), values16.float()
    chain = torch.randperm(700, generator=g)[:530].to(torch.int32)
    lengths = torch.arange(515, 530)                  # a chain's rows: tiles of 8 rows
    query = torch.randn(len(lengths), heads, head_dim, generator=g)
    rows = [chain[:5].tolist(), chain[:300].tolist(), chain[:17].tolist()]

    def calls(k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        tiled = [attention_kernel.paged_attention(query, k, v, chain, torch.zeros(len(lengths), dtype=torch.long),
                                                  lengths, 529, head_dim ** -0.5, threads=threads)
                 for threads in (1, 2)]
        return [*tiled, run(query[:3], k, v, rows, head_dim ** -0.5)]

    initial = attention_kernel.code_path()
    paths = attention_kernel.CODE_PATHS if initial == "avx512" else ("avx2",)
    try:
        for path in paths:
            attention_kernel.code_path(path)
            for half, full in zip(calls(keys16, values16), calls(keys, values), strict=True):
                assert half.dtype == torch.float32 and torch.equal(half, full)
    finally:
        attention_kernel.code_path(initial)
    torch.testing.assert_close(run(query[:3], keys16, values16, rows, head_dim ** -0.5).double(),
                               reference(query[:3], keys, values, rows, head_dim ** -0.5), rtol=1e-5, atol=1e-6)


def test_the_kernel_takes_float32_and_float16_caches() -> None:
    assert attention_kernel.supports(128, torch.float16)
    assert not attention_kernel.supports(128, torch.bfloat16)
