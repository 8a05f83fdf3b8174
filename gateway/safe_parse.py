"""Registers the Generation service with a request parser that never fails inside gRPC.

gRPC answers a request whose bytes do not parse with INTERNAL. Clients deserve INVALID_ARGUMENT, so the parser
returns an `UndecodableRequest` marker instead, and request validation rejects it with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from protos.specmesh.v1 import generate_pb2, generate_pb2_grpc


@dataclass(frozen=True)
class UndecodableRequest:
    reason: str


def parse_generate_request(data: bytes) -> generate_pb2.GenerateRequest | UndecodableRequest:
    try:
        return generate_pb2.GenerateRequest.FromString(data)
    except (DecodeError, UnicodeDecodeError, ValueError) as exc:
        return UndecodableRequest(str(exc) or type(exc).__name__)


def add_generation_servicer(servicer: generate_pb2_grpc.GenerationServicer, server: grpc.aio.Server) -> None:
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=parse_generate_request,
            response_serializer=generate_pb2.GenerateResponse.SerializeToString),
        "Complete": grpc.unary_unary_rpc_method_handler(
            servicer.Complete, request_deserializer=parse_generate_request,
            response_serializer=generate_pb2.CompleteResponse.SerializeToString),
    }
    service = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
