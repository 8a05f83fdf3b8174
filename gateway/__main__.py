"""`python -m gateway`: run the public gateway (flags or SPECMESH_GATEWAY_* environment variables)."""

from __future__ import annotations

import asyncio
import logging
import sys

from gateway.server import build_gateway
from specmesh.config import GatewayConfig, load_config
from specmesh.grpc_server import serve_until_signal


async def _main(argv: list[str]) -> None:
    config = load_config(GatewayConfig, "gateway", argv)
    server = await build_gateway(config)
    await serve_until_signal(server, config.host, config.port, lambda: None)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
