"""Client channels to internal services (one place for message limits, and later TLS and tracing interceptors)."""

from __future__ import annotations

import grpc

from specmesh.config import TlsConfig
from specmesh.rpc.grpc_server import MAX_MESSAGE_BYTES
from specmesh.rpc.security import channel_credentials
from specmesh.telemetry.tracing import client_interceptors

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A restarted service is found again within ~2 s (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 30_000),
    # Each channel its own connections: by default gRPC shares them across every channel to the same address in
    # the process, so a new channel to a service restarted on that address (a replica found again, a gateway
    # built after a crash) inherited the dead connection's reconnect backoff and failed its first calls with
    # "Connection refused" while the service was up.
    ("grpc.use_local_subchannel_pool", 1),
]


def internal_channel(addr: str, tls: TlsConfig | None = None, server_name: str = "") -> grpc.aio.Channel:
    """An aio channel from one specmesh service to another; every call carries W3C trace context.
    TLS (and mutual TLS) when `tls.tls_ca` is set (specmesh.rpc.security.channel_credentials). server_name: the name
    the server's certificate must carry when `addr` is one of its IP addresses (a replica found by DNS)."""
    credentials = channel_credentials(tls) if tls is not None else None
    if credentials is not None:
        options = [*CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", server_name)] if server_name else [])]
        return grpc.aio.secure_channel(addr, credentials, options=options, interceptors=client_interceptors())
    return grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS, interceptors=client_interceptors())
