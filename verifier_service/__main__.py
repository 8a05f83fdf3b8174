"""`python -m verifier_service`: run the verifier service (flags or SPECMESH_VERIFIER_* environment variables)."""

from __future__ import annotations

import asyncio
import logging
import sys

from specmesh.config import VerifierConfig, load_config
from specmesh.rpc.grpc_server import serve_until_signal
from specmesh.telemetry.tracing import setup_tracing
from verifier_service.server import build_verifier


async def _main(argv: list[str]) -> None:
    config = load_config(VerifierConfig, "verifier", argv)
    setup_tracing(config.telemetry, "specmesh-verifier")
    server, engine = build_verifier(config)
    await serve_until_signal(server, config.host, config.port, engine.stop)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s verifier %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
