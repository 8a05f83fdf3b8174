"""Builds the gateway: channels to the verifier and draft service, the tokenizer, the public servicer."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.servicer import GenerationServicer, ModelInfo
from protos.specmesh.v1 import draft_pb2_grpc, generate_pb2, generate_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specmesh.channels import internal_channel
from specmesh.config import GatewayConfig
from specmesh.grpc_server import ServiceServer
from specmesh.models import resolve_model_dir

log = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def fetch_model_info(stub: verifier_pb2_grpc.VerifierStub, wait_s: float) -> verifier_pb2.ModelInfo:
    """Waits up to wait_s for the verifier to answer (it may still be loading its model)."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        try:
            return await stub.GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=5.0, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"verifier not reachable: {exc.code().name} {exc.details()}") from exc
            await asyncio.sleep(0.5)


def load_tokenizer(ref: str, cache_dir: str) -> PreTrainedTokenizerBase:
    model_dir = resolve_model_dir(ref, Path(cache_dir) if cache_dir else None)
    return AutoTokenizer.from_pretrained(str(model_dir))


async def build_gateway(config: GatewayConfig, wait_for_verifier_s: float = 600.0) -> ServiceServer:
    verifier = verifier_pb2_grpc.VerifierStub(internal_channel(config.verifier_addr))
    info = await fetch_model_info(verifier, wait_for_verifier_s)
    tokenizer = load_tokenizer(config.tokenizer or info.model_name, config.cache_dir)
    draft = None
    if config.draft_addr:
        draft = draft_pb2_grpc.DraftStub(internal_channel(config.draft_addr))
    model = ModelInfo(info.model_name, info.max_model_len, frozenset(info.eos_token_ids))
    servicer = GenerationServicer(config, tokenizer, model, verifier, draft)
    log.info("gateway for %s (context %d, draft %s)", info.model_name, info.max_model_len, config.draft_addr or "off")
    return ServiceServer([SERVICE_NAME], lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(servicer, s))
