"""Builds and runs the draft service."""

from __future__ import annotations

from draft_service.engine import DraftEngine
from draft_service.servicer import DraftServicer
from draft_service.warmup import warm_up_engine
from protos.specmesh.v1 import draft_pb2, draft_pb2_grpc
from specmesh.config import DraftConfig
from specmesh.engine.build import build_engine_parts
from specmesh.rpc.grpc_server import ServiceServer
from specmesh.rpc.leases import SessionLeases, reap_forever
from specmesh.rpc.security import peer_interceptors, server_credentials
from specmesh.telemetry.metrics import SessionMetrics, start_metrics

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name


def build_draft(config: DraftConfig) -> tuple[ServiceServer, DraftEngine]:
    credentials = server_credentials(config.tls)          # before the model load: a bad cert path fails fast
    parts = build_engine_parts(config.engine, head_vocab=config.head_vocab)
    engine = DraftEngine(parts.runner, parts.block_manager, parts.max_model_len,
                         config.engine.max_num_batched_tokens, config.engine.max_num_seqs,
                         config.engine.max_queue_len, config.engine.num_threads, config.draft_ahead,
                         config.guesses, config.max_catch_up_tokens)
    engine.set_step_budget(config.engine.step_cost_factor, config.engine.min_prefill_tokens)
    leases = SessionLeases(config.session_lease_s)
    servicer = DraftServicer(engine, parts.loaded.model.config.vocab_size, config.max_draft_tokens,
                             config.max_q_entries, leases, config.limits)
    server = ServiceServer([SERVICE_NAME], lambda s: draft_pb2_grpc.add_DraftServicer_to_server(servicer, s),
                           credentials, peer_interceptors(config.tls))
    server.metrics = start_metrics(config.telemetry, config.host, engine.metrics.registry)
    expired = SessionMetrics(engine.metrics.registry).expired
    server.background.append(lambda: reap_forever(leases, engine.end_session, expired.inc))
    if config.warmup_tokens > 0:               # SERVING only after the replica's own warm-up (warmup.py)
        vocab_size = parts.loaded.model.config.vocab_size
        server.warm_up = lambda: warm_up_engine(engine, config.warmup_tokens, vocab_size, config.max_q_entries)
    engine.start()
    return server, engine
