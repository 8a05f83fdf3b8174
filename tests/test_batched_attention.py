"""Batched paged attention: a sequence's logits do not depend on what shares its forward (int8 rowwise mode, bit for
bit, with the C kernel and with the SDPA fallback), the batched float path matches per-sequence attention, and the
tree hook (`SeqSlice.query_mask`) masks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from specmesh.engine import attention_kernel
from specmesh.engine.build import QUANTIZERS
from specmesh.engine.model_runner import ForwardItem, ModelRunner
from specmesh.engine.paged_attention import PagedBatch, PagedKVCache, SeqSlice, paged_attention_forward
from specmesh.models import resolve_model_dir

BLOCK = 4
BLOCKS_PER_SEQ = 16


def runner_for(dtype: str) -> ModelRunner:
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("tiny-target")), dtype=torch.float32)
    if dtype in QUANTIZERS:
        QUANTIZERS[dtype][0](model)
    return ModelRunner(model, num_blocks=8 * BLOCKS_PER_SEQ + 1, block_size=BLOCK, batch_invariant=dtype in QUANTIZERS)


def table(seq: int) -> list[int]:
    """Sequence `seq`'s blocks, interleaved with the others' so that gathers really are by block."""
    return [1 + b * 8 + seq for b in range(BLOCKS_PER_SEQ)]


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(runner: ModelRunner, seq: int, ids: list[int]) -> None:
    runner.forward([ForwardItem(ids, 0, table(seq), 1)])


@pytest.mark.parametrize("dtype", ["int8", "int4", "float32"])
def test_logits_alone_equal_logits_in_an_8_sequence_batch(dtype: str) -> None:
    runner = runner_for(dtype)
    contexts = [random_ids(5 + 3 * s, seed=s) for s in range(8)]          # different context lengths
    drafts = [random_ids(1 + (s % 3) * 4, seed=100 + s) for s in range(8)]  # 1, 5 or 9 new tokens
    for s, ids in enumerate(contexts):
        prefill(runner, s, ids)
    alone = [runner.forward([ForwardItem(drafts[s], len(contexts[s]), table(s), len(drafts[s]))])[0]
             for s in range(8)]
    together = runner.forward([ForwardItem(drafts[s], len(contexts[s]), table(s), len(drafts[s])) for s in range(8)])
    if dtype in QUANTIZERS:
        for s in range(8):
            assert torch.equal(alone[s], together[s]), s
    else:   # fp32 GEMMs differ with the number of rows; the attention itself is covered below
        for s in range(8):
            torch.testing.assert_close(alone[s], together[s], rtol=1e-4, atol=1e-4)


def test_int8_verified_block_equals_one_token_decodes_inside_a_batch() -> None:
    """A 9-token verify of sequence 0 next to 7 other sequences == its 9 one-token decodes, each alone."""
    runner = runner_for("int8")
    contexts = [random_ids(6 + s, seed=s) for s in range(8)]
    for s, ids in enumerate(contexts):
        prefill(runner, s, ids)
    block = random_ids(9, seed=42)
    others = [ForwardItem(random_ids(1 + s % 4, seed=50 + s), len(contexts[s]), table(s), 1) for s in range(1, 8)]
    verified = runner.forward([*others[:3], ForwardItem(block, len(contexts[0]), table(0), 9), *others[3:]])[3]
    start = len(contexts[0])
    single = [runner.forward([ForwardItem(block[i:i + 1], start + i, table(0), 1)])[0][0] for i in range(9)]
    assert torch.equal(verified, torch.stack(single))


def use_sdpa_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rowwise attention without the C kernel: the per-row SDPA fallback (no compiler, or a non-float32 cache)."""
    monkeypatch.setattr(attention_kernel, "supports", lambda head_dim, dtype: False)


@pytest.fixture
def sdpa_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    use_sdpa_rows(monkeypatch)


@pytest.mark.usefixtures("sdpa_rows")
def test_sdpa_fallback_logits_alone_equal_logits_in_an_8_sequence_batch() -> None:
    test_logits_alone_equal_logits_in_an_8_sequence_batch("int8")


def reference_attention(query, keys, values, seq_slices, scaling):
    """Per-sequence causal SDPA over unpadded contexts (the pre-batching implementation)."""
    outs = []
    for s, k, v in zip(seq_slices, keys, values, strict=True):
        q = query[0, :, s.query_start:s.query_start + s.query_len]
        ctx = k.shape[1]
        mask = torch.arange(ctx)[None] <= torch.arange(ctx - s.query_len, ctx)[:, None]
        if s.query_mask is not None:
            mask[:, ctx - s.query_len:] &= s.query_mask
        outs.append(F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scaling,
                                                   enable_gqa=True)[0])
    return torch.cat(outs, dim=1).transpose(0, 1)


@pytest.mark.parametrize("mode", ["batched", "rowwise-kernel", "rowwise-sdpa"])
@pytest.mark.parametrize("tree", [False, True])
def test_batched_attention_matches_per_sequence_attention(mode: str, tree: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    rowwise = mode != "batched"
    if mode == "rowwise-sdpa":
        use_sdpa_rows(monkeypatch)
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    cache = PagedKVCache(1, 40, BLOCK, kv_heads, dim, torch.float32)
    lens = [(3, 5), (9, 1), (0, 7)]                                          # (cached, new) per sequence
    tables = [[1 + b * 3 + i for b in range(10)] for i in range(3)]
    contexts = [(torch.randn(kv_heads, c + n, dim, generator=g), torch.randn(kv_heads, c + n, dim, generator=g))
                for c, n in lens]
    for (c, _), t, (k, v) in zip(lens, tables, contexts, strict=True):      # cached part written beforehand
        slots = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(c)], dtype=torch.long)
        cache.write(0, slots, k[:, :c].transpose(0, 1), v[:, :c].transpose(0, 1))
    seqs, slot_mapping, start = [], [], 0
    parents = [-1, 0, 0, 1, 2, 2, 3]
    for (c, n), t in zip(lens, tables, strict=True):
        mask = None
        if tree and n > 1:
            mask = torch.eye(n, dtype=torch.bool)
            for i in range(n):
                j = parents[i]
                while j >= 0:
                    mask[i, j] = True
                    j = parents[j]
        seqs.append(SeqSlice(start, n, c + n, t[:-(-(c + n) // BLOCK)], mask))
        slot_mapping += [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(c, c + n)]
        start += n
    batch = PagedBatch.build(cache, torch.tensor(slot_mapping), seqs, rowwise)
    assert (batch.row_keys is not None) == (mode == "rowwise-kernel")
    query = torch.randn(1, heads, start, dim, generator=g)
    new_k = torch.cat([k[:, c:] for (c, _), (k, _) in zip(lens, contexts, strict=True)], dim=1)[None]
    new_v = torch.cat([v[:, c:] for (c, _), (_, v) in zip(lens, contexts, strict=True)], dim=1)[None]
    layer = torch.nn.Module()
    layer.layer_idx = 0
    out, _ = paged_attention_forward(layer, query, new_k, new_v, None, scaling=0.3, paged_batch=batch)
    expected = reference_attention(query, [k for k, _ in contexts], [v for _, v in contexts], seqs, 0.3)
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_logits_do_not_depend_on_the_thread_count(dtype: str) -> None:
    """The engine may raise its threads for big steps (num_threads_max): a block verified on 2 threads equals the
    one-token decodes on 1 thread."""
    runner = runner_for(dtype)
    context, block = random_ids(50, seed=1), random_ids(9, seed=2)
    prefill(runner, 0, context)
    single = [runner.forward([ForwardItem(block[i:i + 1], 50 + i, table(0), 1)])[0][0] for i in range(9)]
    torch.set_num_threads(2)
    try:
        verified = runner.forward([ForwardItem(block, 50, table(0), 9)])[0]
        alone_on_two = runner.forward([ForwardItem(block[:1], 50, table(0), 1)])[0][0]
    finally:
        torch.set_num_threads(1)
    assert torch.equal(verified, torch.stack(single))
    assert torch.equal(alone_on_two, single[0])


@pytest.mark.parametrize("kernel", [True, False])
def test_rowwise_attention_is_the_same_on_1_and_2_threads(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2.5-1.5B's head shape (12 heads, 2 KV heads, 128 dims): SDPA's 2-thread path for one row differs in the
    last bits, so the SDPA fallback runs its calls on one thread (the kernel is single-threaded)."""
    if not kernel:
        use_sdpa_rows(monkeypatch)
    g = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, 40, 16, 2, 128, torch.float32)
    context = 100
    cache.write(0, torch.arange(context), torch.randn(context, 2, 128, generator=g),
                torch.randn(context, 2, 128, generator=g))
    batch = PagedBatch.build(cache, torch.tensor([context]), [SeqSlice(0, 1, context + 1, list(range(7)))], True)
    query, key, value = (torch.randn(1, h, 1, 128, generator=g) for h in (12, 2, 2))
    layer = torch.nn.Module()
    layer.layer_idx = 0
    one, _ = paged_attention_forward(layer, query, key, value, None, scaling=0.1, paged_batch=batch)
    torch.set_num_threads(2)
    try:
        two, _ = paged_attention_forward(layer, query, key, value, None, scaling=0.1, paged_batch=batch)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)


def test_thread_policy_uses_more_threads_for_big_steps() -> None:
    from specmesh.engine.batched import BatchedEngine
    from specmesh.engine.block_manager import BlockManager
    from specmesh.engine.scheduled import ForwardRequest, SeqState

    class Engine(BatchedEngine):
        sessions: dict = {}

        def idle_seqs(self):
            return []

        def finish(self, request, logits):
            request.seq.num_computed = len(request.seq.token_ids)
            self.scheduler.commit(request.seq)

    runner = runner_for("int8")
    engine = Engine("test", runner, BlockManager(64, BLOCK), 256, 8, num_threads=1)
    engine.set_thread_policy(2, min_tokens=8)
    seen: list[int] = []
    real = runner.forward_flat
    runner.forward_flat = lambda items: (seen.append(torch.get_num_threads()), real(items))[1]
    try:
        for n in (4, 12, 3):
            engine.scheduler.enqueue(ForwardRequest(SeqState(n, random_ids(n, seed=n), n), [], 1))
            engine.step()
    finally:
        torch.set_num_threads(1)
    assert seen == [1, 2, 1]
