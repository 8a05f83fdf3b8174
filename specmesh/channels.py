"""Client channels to internal services (one place for message limits, and later TLS and tracing interceptors)."""

from __future__ import annotations

import grpc

from specmesh.grpc_server import MAX_MESSAGE_BYTES

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def internal_channel(addr: str) -> grpc.aio.Channel:
    """An aio channel from one specmesh service to another."""
    return grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS)
