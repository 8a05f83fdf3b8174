"""A draft replica's own warm-up (SPECMESH_DRAFT_WARMUP_TOKENS): health says SERVING only after a greedy session drafted
through its engine and ended with its KV blocks free (the mechanism, ServiceServer.warm_up:
tests/test_server_warm_up.py)."""

from __future__ import annotations

from draft_service.server import build_draft
from draft_service.warmup import WARMUP_DRAFT_TOKENS, WARMUP_SESSION_ID, _verdict
from specmesh.config import DraftConfig, EngineConfig
from specmesh.spec.sampling import SamplingParams
from tests.health_probe import SERVING, until_status


def test_the_warm_up_verdicts_accept_a_whole_block_then_correct_half_of_one() -> None:
    assert _verdict([5, 6, 7, 8], 0, 100) == [5, 6, 7, 8, 9]
    assert _verdict([5, 6, 7, 8], 1, 100) == [5, 6, 8]
    assert _verdict([98, 99], 1, 100) == [98, 0]


async def test_a_draft_replica_reports_serving_only_after_its_warm_up_session() -> None:
    config = DraftConfig(port=0, warmup_tokens=12,
                         engine=EngineConfig(model="tiny-draft", kv_cache_memory_mb=16, dtype="float32"))
    server, engine = build_draft(config)
    try:
        addr = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
        await until_status(addr, SERVING, timeout_s=60)
        # the moment it says SERVING: the warm-up prefilled and drafted 12 tokens in blocks of 4, and ended
        assert engine.num_steps >= 12 // WARMUP_DRAFT_TOKENS
        assert WARMUP_SESSION_ID not in engine.sessions and engine.block_manager.num_used_blocks == 0
        proposal = await engine.propose("client", 4, [5, 6, 7, 8], 3, SamplingParams(), 8).future
        assert len(proposal.draft_ids) == 3
        engine.end_session("client")
    finally:
        await server.stop()
