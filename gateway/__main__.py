"""`python -m gateway`: run the public gateway (flags or SPECMESH_GATEWAY_* environment variables)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import grpc

from gateway.http_edge import http_ssl_context
from gateway.openai_http import ServedModel, add_loopback_port, start_openai_http
from gateway.server import build_gateway_parts
from specmesh.config import GatewayConfig, load_config
from specmesh.rpc.grpc_server import serve_until_signal
from specmesh.rpc.security import load_api_keys
from specmesh.telemetry.tracing import setup_tracing


async def _main(argv: list[str]) -> None:
    config = load_config(GatewayConfig, "gateway", argv)
    setup_tracing(config.telemetry, "specmesh-gateway")
    gateway = await build_gateway_parts(config)
    server = gateway.server
    if config.http_port:
        ssl_context = http_ssl_context(config.tls)
        model = ServedModel(gateway.model.name, gateway.model.max_model_len, int(time.time()))
        loopback = gateway.loopback or add_loopback_port(server)
        http = await start_openai_http(model, config.host, config.http_port, lambda: loopback,
                                       grpc.aio.insecure_channel, gateway.metrics, gateway.tokenizer, ssl_context,
                                       load_api_keys(config), config.limits)
        server.on_stop.append(http.close)
        logging.getLogger(__name__).info("OpenAI-compatible HTTP API on %s://%s:%d/v1",
                                         "https" if ssl_context else "http", config.host, http.port)
    await serve_until_signal(server, config.host, config.port, lambda: None)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
