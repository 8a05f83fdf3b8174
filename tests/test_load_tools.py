"""Load generators run unmodified against the HTTP API (issue 13): guidellm 0.8.1 and aiperf 0.13.0, each from its
own venv (`make load-tools`, created here when missing: PyPI on the first run, minutes), a short synchronous and a
short concurrent run on the tiny models; their JSON reports must show every request completed, none failed, and
output tokens per second > 0. The commands are README's "Benchmark your deployment". SPECMESH_SKIP_LOAD_TOOLS=1
skips this file (offline machines)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
import pytest_asyncio

from gateway.openai_http import ServedModel, start_openai_http
from gateway.server import build_gateway_parts
from specmesh.config import GatewayConfig
from specmesh.models import resolve_model_dir
from tests.stack import start_draft, start_verifier

ROOT = Path(__file__).resolve().parent.parent
TOOLS = {"guidellm": ROOT / ".venv-guidellm" / "bin" / "guidellm", "aiperf": ROOT / ".venv-aiperf" / "bin" / "aiperf"}
OUTPUT_TOKENS = 8
RUNS = {"synchronous": (1, 5), "concurrent": (4, 8)}      # (concurrency, requests)

pytestmark = [pytest.mark.timeout(1800),
              pytest.mark.skipif(os.environ.get("SPECMESH_SKIP_LOAD_TOOLS") == "1",
                                 reason="SPECMESH_SKIP_LOAD_TOOLS=1")]


def tool(name: str) -> Path:
    """The tool's executable, its venv made with `make` first when missing (pip from PyPI)."""
    path = TOOLS[name]
    if not path.exists():
        done = subprocess.run(["make", "-s", str(path.relative_to(ROOT))], cwd=ROOT, capture_output=True, text=True,
                              timeout=1200)
        assert done.returncode == 0 and path.exists(), f"make {path}: {done.stdout}{done.stderr}"
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def base_url():
    verifier, draft = await start_verifier(), await start_draft()
    config = GatewayConfig(port=0, verifier_addr=verifier.addr, draft_addr=draft.addr, enable_cache=False,
                           enable_ngram=False, suffix_drafting=False)
    gateway = await build_gateway_parts(config, wait_for_verifier_s=30)
    port = await gateway.server.start("127.0.0.1", 0)
    http = await start_openai_http(ServedModel("tiny-target", gateway.model.max_model_len, 0), "127.0.0.1", 0,
                                   lambda: f"127.0.0.1:{port}", metrics=gateway.metrics, tokenizer=gateway.tokenizer)
    yield f"http://127.0.0.1:{http.port}"
    await http.close()
    await gateway.server.stop(0)
    for running in (draft, verifier):
        await running.stop()


async def run_tool(args: list[str], cwd: Path) -> None:
    """Runs a load generator as a subprocess (the stack keeps serving on this event loop)."""
    # aiperf 0.13 cannot load a local tokenizer directory with HF_HUB_OFFLINE=1; a local path needs no network
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    proc = await asyncio.create_subprocess_exec(*args, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=600)
    assert proc.returncode == 0, out.decode(errors="replace")[-4000:]


@pytest.mark.parametrize("run", list(RUNS))
async def test_guidellm(base_url: str, run: str, tmp_path: Path) -> None:
    guidellm = await asyncio.to_thread(tool, "guidellm")
    concurrency, requests = RUNS[run]
    profile = "kind=synchronous" if run == "synchronous" else f"kind=concurrent,streams={concurrency}"
    report = tmp_path / "guidellm.json"
    await run_tool([str(guidellm), "run",
                    "--backend", f"kind=openai_http,target={base_url},model=tiny-target",
                    "--profile", profile, "--constraint", f"kind=max_requests,count={requests}",
                    "--tokenizer", f"kind=huggingface_auto,model={resolve_model_dir('tiny-target')}",
                    "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
                    "--output", f"kind=json,path={report}", "--disable-console"], tmp_path)
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": requests, "errored": 0, "incomplete": 0, "total": requests}
    assert metrics["output_tokens_per_second"]["successful"]["mean"] > 0
    assert 0 < metrics["output_token_count"]["successful"]["total_sum"] <= requests * OUTPUT_TOKENS


@pytest.mark.parametrize("run", list(RUNS))
async def test_aiperf(base_url: str, run: str, tmp_path: Path) -> None:
    aiperf = await asyncio.to_thread(tool, "aiperf")
    concurrency, requests = RUNS[run]
    await run_tool([str(aiperf), "profile", "--model", "tiny-target", "--url", base_url, "--endpoint-type", "chat",
                    "--streaming", "--tokenizer", str(resolve_model_dir("tiny-target")),
                    "--synthetic-input-tokens-mean", "16", "--output-tokens-mean", str(OUTPUT_TOKENS),
                    "--extra-inputs", "ignore_eos:true", "--concurrency", str(concurrency),
                    "--request-count", str(requests), "--random-seed", "1", "--artifact-dir", str(tmp_path / "out")],
                   tmp_path)
    report = json.loads((tmp_path / "out" / "profile_export_aiperf.json").read_text())
    assert report["completed_request_count"]["avg"] == requests and report["request_error_rate"]["avg"] == 0
    assert report["error_summary"] == [] and report["is_complete"]
    assert report["output_token_throughput"]["avg"] > 0
    assert report["usage_completion_tokens"]["sum"] == requests * OUTPUT_TOKENS     # the server's own counts
