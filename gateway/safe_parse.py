"""Registers the Generation service. Its requests are parsed safely like every service's (specmesh/rpc/rpc_guard.py).

gRPC answers a request whose bytes do not parse with INTERNAL. The shared `RpcGuard` interceptor of every
`ServiceServer` gives each method a parser that returns an `UndecodableRequest` marker instead, and answers it
INVALID_ARGUMENT before the servicer runs. `parse_generate_request` is that parser for GenerateRequest, for
callers outside gRPC.
"""

from __future__ import annotations

import grpc

from protos.specmesh.v1 import generate_pb2, generate_pb2_grpc
from specmesh.rpc.rpc_guard import UndecodableRequest, safe_deserializer

__all__ = ["UndecodableRequest", "add_generation_servicer", "parse_generate_request"]

_parse = safe_deserializer(generate_pb2.GenerateRequest.FromString)


def parse_generate_request(data: bytes) -> generate_pb2.GenerateRequest | UndecodableRequest:
    assert _parse is not None
    parsed: generate_pb2.GenerateRequest | UndecodableRequest = _parse(data)
    return parsed


def add_generation_servicer(servicer: generate_pb2_grpc.GenerationServicer, server: grpc.aio.Server) -> None:
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
