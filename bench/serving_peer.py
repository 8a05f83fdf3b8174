"""llama-server as the serving benchmark's peer: continuous batching with 4 slots (`-np 4`), target-only, on the
preset's own GGUF file (`specmesh models fetch` puts it under the model cache, `$SPECMESH_CACHE_DIR/gguf`), the same
threads and, with `--cpus`, the same cores (`taskset -c`) as the specmesh stack. Build: PEERS.md (shared docs).

The binary: `--llama-server PATH`, else `$SPECMESH_LLAMA_SERVER`, else `llama-server` on PATH; none: the peer is
skipped and the report says so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from bench.common import free_port_block, log
from bench.llamacpp_peer import GGUF_FILES, stop_server, wait_healthy
from specmesh.config import default_cache_dir

SERVER_ENV = "SPECMESH_LLAMA_SERVER"
SLOTS = 4
CONTEXT_PER_SLOT = 4096 + 1024          # the longest prompt of the mix and its answer


def find_server(explicit: str = "") -> str:
    """The llama-server binary: `explicit`, $SPECMESH_LLAMA_SERVER, or on PATH; '' when none is found."""
    for candidate in (explicit, os.environ.get(SERVER_ENV, "")):
        if candidate:
            if not Path(candidate).is_file():
                raise SystemExit(f"llama-server binary {candidate} not found")
            return candidate
    return shutil.which("llama-server") or ""


def target_gguf(preset: str) -> Path | None:
    """The preset's target GGUF file, or None when the preset has none or it is not fetched."""
    names = GGUF_FILES.get(preset)
    path = default_cache_dir() / "gguf" / names[0] if names else None
    return path if path is not None and path.is_file() else None


def server_command(server: str, gguf: Path, threads: int, port: int, cpus: str = "") -> list[str]:
    pin = ["taskset", "-c", cpus] if cpus else []
    return [*pin, server, "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(SLOTS),
            "-c", str(SLOTS * CONTEXT_PER_SLOT), "--cont-batching", "-ngl", "0", "--no-webui",
            "--host", "127.0.0.1", "--port", str(port)]


@contextlib.contextmanager
def running_server(server: str, gguf: Path, threads: int, cpus: str = "") -> Iterator[str]:
    """A llama-server for the block; yields its base URL."""
    port = free_port_block(1)
    cmd = server_command(server, gguf, threads, port, cpus)
    log(f"starting llama-server: {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, proc)
        yield base_url
    finally:
        stop_server(proc)
