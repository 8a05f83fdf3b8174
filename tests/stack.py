"""In-process stacks for the tests: verifier, draft service and gateway servers in one event loop.

Each service's engine runs on its own thread exactly as in production; only the process boundary is missing.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from draft_service.engine import DraftEngine
from draft_service.server import build_draft
from gateway.discovery import Resolver, resolve_dns
from gateway.server import build_gateway
from specmesh.config import DraftConfig, EngineConfig, GatewayConfig, VerifierConfig
from specmesh.models import resolve_model_dir
from specmesh.rpc.grpc_server import ServiceServer
from verifier_service.engine import VerifierEngine
from verifier_service.server import build_verifier


@dataclass
class Running:
    server: ServiceServer
    port: int
    engine: VerifierEngine | DraftEngine | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.server.stop(0)
        if self.engine is not None:
            self.engine.stop()


def slow_forwards(monkeypatch: pytest.MonkeyPatch, runner: Any, seconds: float) -> None:
    """Every forward of `runner` takes `seconds` longer. The tiny model's forward is faster than a gRPC hop, so
    concurrent sessions' calls rarely share one; slowed, they queue up behind it and do."""
    forward_flat = runner.forward_flat

    def slow_forward_flat(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return forward_flat(*args, **kwargs)
    monkeypatch.setattr(runner, "forward_flat", slow_forward_flat)


async def start_verifier(model: str = "tiny-target", decode_ahead_tokens: int = 0, **engine: object) -> Running:
    """decode_ahead_tokens: off unless a test asks (the service default is on): with it, a round may carry several
    target tokens, so tests that count rounds of a drafting tier or prefetch hits would depend on timing. The
    exactness, fault, mixed-traffic and fuzz tests turn it on. float32 unless a test asks (not the service's "auto"):
    the outputs are compared with plain transformers greedy decoding (reference_greedy)."""
    config = VerifierConfig(port=0, decode_ahead_tokens=decode_ahead_tokens,
                            engine=dataclasses.replace(EngineConfig(model=model, kv_cache_memory_mb=16,
                                                                    dtype="float32"), **engine))
    server, eng = build_verifier(config)
    return Running(server, await server.start("127.0.0.1", 0), eng)


async def start_draft(model: str = "tiny-draft", draft_ahead: bool = True, head_vocab: int = 0,
                      **engine: object) -> Running:
    config = DraftConfig(port=0, draft_ahead=draft_ahead, head_vocab=head_vocab,
                         engine=dataclasses.replace(EngineConfig(model=model, kv_cache_memory_mb=16,
                                                                 dtype="float32"), **engine))
    server, eng = build_draft(config)
    return Running(server, await server.start("127.0.0.1", 0), eng)


async def start_gateway(verifier_addr: str, draft_addr: str, resolver: Resolver = resolve_dns,
                        **overrides: object) -> Running:
    # Tests measure the draft service alone unless they opt into the cache / n-gram tiers (tests/test_tiers.py) or
    # suffix drafting. Fixed draft lengths too, unless a test opts into the adaptive controller; prefetch on unless a
    # test turns it off.
    overrides = {"enable_cache": False, "enable_ngram": False, "adaptive_draft_length": False, "suffix_drafting": False,
                 "draft_prefetch": True, **overrides}
    config = GatewayConfig(port=0, verifier_addr=verifier_addr, draft_addr=draft_addr, **overrides)
    server = await build_gateway(config, wait_for_verifier_s=30, resolver=resolver)
    return Running(server, await server.start("127.0.0.1", 0))


_REFERENCE_MODELS: dict[str, torch.nn.Module] = {}


@torch.inference_mode()
def reference_greedy(prompt_ids: list[int], max_new_tokens: int, model_ref: str = "tiny-target") -> list[int]:
    """Target-only greedy decoding with plain transformers (sdpa + DynamicCache), independent of specmesh's engine."""
    if model_ref not in _REFERENCE_MODELS:
        path = resolve_model_dir(model_ref)
        _REFERENCE_MODELS[model_ref] = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="sdpa").eval()
    model = _REFERENCE_MODELS[model_ref]
    cache = DynamicCache(config=model.config)
    input_ids = torch.tensor([prompt_ids])
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=input_ids, cache=cache, use_cache=True).logits[0, -1]
        token = int(torch.argmax(logits))
        out.append(token)
        input_ids = torch.tensor([[token]])
    return out
