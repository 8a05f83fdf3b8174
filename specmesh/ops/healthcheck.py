"""`python -m specmesh.ops.healthcheck ADDR`: exit 0 if the service at ADDR reports SERVING over grpc.health.v1.

Used by the container health checks (docker-compose) and handy by hand. Exit codes: 0 SERVING, 1 any other status,
2 unreachable / error. TLS: pass --ca (and --cert/--key for mutual TLS) when the service serves TLS.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _channel(addr: str, ca: str, cert: str, key: str, server_name: str) -> grpc.Channel:
    if not ca:
        return grpc.insecure_channel(addr)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(addr, creds, options=options)


def check(addr: str, service: str = "", timeout_s: float = 3.0, ca: str = "", cert: str = "", key: str = "",
          server_name: str = "") -> int:
    """The health status (health_pb2.HealthCheckResponse.ServingStatus) of `service` at addr."""
    with _channel(addr, ca, cert, key, server_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return reply.status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.ops.healthcheck", description=__doc__)
    parser.add_argument("addr", help="host:port of a specmesh service")
    parser.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--ca", default="", help="CA certificate (PEM): connect with TLS")
    parser.add_argument("--cert", default="", help="client certificate (PEM) for mutual TLS")
    parser.add_argument("--key", default="", help="client private key (PEM) for mutual TLS")
    parser.add_argument("--server-name", default="", help="TLS server name to verify, if not the host in addr")
    args = parser.parse_args(argv)
    try:
        status = check(args.addr, args.service, args.timeout, args.ca, args.cert, args.key, args.server_name)
    except grpc.RpcError as exc:
        print(f"{args.addr}: {exc.code().name} {exc.details()}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{args.addr}: {exc}", file=sys.stderr)
        return 2
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.addr}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
