"""`python -m draft_service`: run the draft service (flags or SPECMESH_DRAFT_* environment variables)."""

from __future__ import annotations

import asyncio
import logging
import sys

from draft_service.server import build_draft
from specmesh.config import DraftConfig, load_config
from specmesh.rpc.grpc_server import serve_until_signal
from specmesh.telemetry.tracing import setup_tracing


async def _main(argv: list[str]) -> None:
    config = load_config(DraftConfig, "draft", argv)
    setup_tracing(config.telemetry, "specmesh-draft")
    server, engine = build_draft(config)
    await serve_until_signal(server, config.host, config.port, engine.stop)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s draft %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
