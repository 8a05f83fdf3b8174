"""A verifier replica's own warm-up (SPECMESH_VERIFIER_WARMUP_TOKENS): health says SERVING only after a greedy session
ran through its engine and ended with its KV blocks free (the mechanism, ServiceServer.warm_up:
tests/test_server_warm_up.py)."""

from __future__ import annotations

from specmesh.config import EngineConfig, VerifierConfig
from specmesh.spec.sampling import SamplingParams
from tests.health_probe import SERVING, until_status
from verifier_service.server import build_verifier
from verifier_service.warmup import WARMUP_SESSION_ID


async def test_a_replica_reports_serving_only_after_its_warm_up_session() -> None:
    config = VerifierConfig(port=0, warmup_tokens=8,
                            engine=EngineConfig(model="tiny-target", kv_cache_memory_mb=16, dtype="float32"))
    server, engine = build_verifier(config)
    try:
        addr = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
        await until_status(addr, SERVING, timeout_s=60)
        # the moment it says SERVING: the warm-up prefilled and verified (undrafted and drafted rows), and ended
        assert engine.num_steps >= 3
        assert WARMUP_SESSION_ID not in engine.sessions and engine.block_manager.num_used_blocks == 0
        result = await engine.start_session("client", [5, 6, 7, 8], SamplingParams(), max_new_tokens=4).future
        assert len(result.token_ids) == 1
        engine.end_session("client")
    finally:
        await server.stop()

