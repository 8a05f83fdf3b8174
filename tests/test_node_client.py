"""The Node.js example client (examples/node, @grpc/grpc-js + @grpc/proto-loader loading protos/ directly) streams
the same greedy generation as the Python client."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import pytest_asyncio

from specmesh import client
from tests.stack import start_draft, start_gateway, start_verifier

NODE_DIR = Path(__file__).resolve().parent.parent / "examples" / "node"
PROMPT = "def fibonacci(n):\n    return"

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (Node.js 18+ needed)")


def ensure_node_client() -> Path:
    """examples/node/client.js with its dependencies installed (npm ci from the committed package-lock.json)."""
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        npm = shutil.which("npm")
        assert npm is not None, "node is installed but npm is not"
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=300)
    return NODE_DIR / "client.js"


@pytest.fixture(scope="module")
def node_client() -> Path:
    return ensure_node_client()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway():
    verifier = await start_verifier()
    draft = await start_draft()
    gw = await start_gateway(verifier.addr, draft.addr)
    yield gw
    for running in (gw, draft, verifier):
        await running.stop()


async def run_node(script: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        "node", str(script), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    return proc.returncode, out.decode(), err.decode()


async def python_generation(addr: str, **kwargs) -> tuple[str, list[int]]:
    responses = [r async for r in client.stream(addr, client.make_request(PROMPT, **kwargs), timeout_s=120)]
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids]


async def test_node_client_streams_the_same_greedy_text_as_python(gateway, node_client: Path) -> None:
    text, ids = await python_generation(gateway.addr, max_new_tokens=32, ignore_eos=True, num_draft_tokens=3)
    assert len(ids) == 32 and text
    args = ["--addr", gateway.addr, "--max-new-tokens", "32", "--ignore-eos", "--num-draft-tokens", "3"]
    code, out, err = await run_node(node_client, *args, PROMPT)
    assert code == 0, err
    assert out == text                                       # streamed text, printed chunk by chunk
    assert "32 tokens" in err and "finish FINISH_REASON_LENGTH" in err
    code, out, err = await run_node(node_client, *args, "--json", PROMPT)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["text"] == text and summary["token_ids"] == ids
    assert summary["usage"]["completion_tokens"] == 32 and summary["usage"]["num_drafted_tokens"] > 0


async def test_node_client_reports_invalid_argument(gateway, node_client: Path) -> None:
    code, _, err = await run_node(node_client, "--addr", gateway.addr, "--temperature=-1", PROMPT)
    assert code == 1 and "INVALID_ARGUMENT" in err
