"""Builds and runs the verifier service."""

from __future__ import annotations

import asyncio

from protos.specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from specmesh.config import VerifierConfig
from specmesh.engine.build import build_engine_parts
from specmesh.rpc.grpc_server import ServiceServer
from specmesh.rpc.leases import SessionLeases, reap_forever
from specmesh.rpc.security import peer_interceptors, server_credentials
from specmesh.telemetry.metrics import SessionMetrics, start_metrics
from verifier_service.engine import VerifierEngine
from verifier_service.servicer import VerifierServicer
from verifier_service.tenant_share import TenantShare
from verifier_service.warmup import warm_up_engine

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


def build_verifier(config: VerifierConfig) -> tuple[ServiceServer, VerifierEngine]:
    credentials = server_credentials(config.tls)          # before the model load: a bad cert path fails fast
    parts = build_engine_parts(config.engine)
    engine = VerifierEngine(parts.runner, parts.block_manager, parts.max_model_len,
                            config.engine.max_num_batched_tokens, config.engine.max_num_seqs,
                            config.engine.max_queue_len, config.engine.num_threads, config.decode_ahead_tokens,
                            parts.loaded.eos_token_ids)
    engine.set_thread_policy(config.engine.num_threads_max, config.engine.max_threads_min_tokens)
    engine.set_step_budget(config.engine.step_cost_factor, config.engine.min_prefill_tokens)
    engine.ahead.threads = config.decode_ahead_threads
    engine.ahead.beside_drafts = config.decode_ahead_beside_drafts
    engine.ahead.guesses = config.decode_ahead_guesses
    engine.gather.max_wait_s = config.batch_gather_ms / 1000
    leases = SessionLeases(config.session_lease_s)
    servicer = VerifierServicer(engine, parts.loaded.name, parts.loaded.model.config.vocab_size,
                                parts.loaded.eos_token_ids, leases, config.max_draft_tokens,
                                config.limits, TenantShare(engine.max_num_sessions, config.tenant_reserve_sessions))
    server = ServiceServer([SERVICE_NAME],
                           lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s), credentials,
                           peer_interceptors(config.tls))
    server.metrics = start_metrics(config.telemetry, config.host, engine.metrics.registry)
    server.drain = lambda: drain_sessions(engine)
    expired = SessionMetrics(engine.metrics.registry).expired
    server.background.append(lambda: reap_forever(leases, engine.end_session, expired.inc))
    if config.warmup_tokens > 0:               # SERVING only after the replica's own warm-up (warmup.py)
        vocab_size = parts.loaded.model.config.vocab_size
        server.warm_up = lambda: warm_up_engine(engine, config.warmup_tokens, vocab_size)
    engine.start()
    return server, engine


async def drain_sessions(engine: VerifierEngine, poll_s: float = 0.05) -> None:
    """Refuse new sessions and wait until the running ones have ended (the caller bounds the wait)."""
    engine.draining = True
    while engine.sessions:
        await asyncio.sleep(poll_s)
