"""Clients in other languages, with the exact commands protos/README.md documents (read from it, run as written from
the repository root): the Node.js example client (examples/node, @grpc/grpc-js + @grpc/proto-loader loading protos/
directly) streams the same greedy generation as the Python client; protoc generates Go, C++ and Java stubs, and the
C++ and Java messages serialize a request to the same bytes as the Python stubs when a compiler is available."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import pytest_asyncio

from protos.specmesh.v1 import generate_pb2
from specmesh.ops import client
from tests.stack import start_draft, start_gateway, start_verifier

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "examples" / "node"
README = (ROOT / "protos" / "README.md").read_text(encoding="utf-8")
PROMPT = "def fibonacci(n):"
README_ADDR = "127.0.0.1:50051"

needs_node = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (Node.js 18+ needed)")


def documented(prefix: str) -> str:
    """The one line of protos/README.md that starts with `prefix` (a command in a code block)."""
    lines = [line for line in README.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"protos/README.md should document exactly one `{prefix}...` line, found {lines}"
    return lines[0]


def run_documented(command: str, out: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs a README line with bash from the repository root, `$OUT` = out."""
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env={**os.environ, "OUT": str(out)}, text=True,
                          capture_output=True, timeout=timeout)


def test_readme_states_the_include_path_rule() -> None:
    assert "-I <repo root>" in README and 'import "protos/specmesh/v1/common.proto";' in README
    for proto in glob.glob(str(ROOT / "protos" / "specmesh" / "v1" / "*.proto")):
        imports = re.findall(r'^import "([^"]+)";', Path(proto).read_text(), flags=re.MULTILINE)
        assert all(i.startswith("protos/specmesh/v1/") for i in imports), (proto, imports)


# --------------------------------------------------------------------------- Node.js


def ensure_node_client() -> list[str]:
    """The documented client command, its dependencies installed with the documented `npm ci` line."""
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        assert shutil.which("npm") is not None, "node is installed but npm is not"
        result = run_documented(documented("cd examples/node && npm ci"), ROOT, timeout=300)
        assert result.returncode == 0, result.stderr
    return shlex.split(documented("node examples/node/client.js"))


@pytest.fixture(scope="module")
def node_command() -> list[str]:
    return ensure_node_client()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway():
    verifier = await start_verifier()
    draft = await start_draft()
    gw = await start_gateway(verifier.addr, draft.addr)
    yield gw
    for running in (gw, draft, verifier):
        await running.stop()


def with_addr(command: list[str], addr: str, *extra: str) -> list[str]:
    """The documented command against the test gateway, extra flags before the prompt."""
    assert README_ADDR in command and command[-1] == PROMPT
    return [addr if arg == README_ADDR else arg for arg in command[:-1]] + [*extra, command[-1]]


async def run_node(command: list[str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*command, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    return proc.returncode, out.decode(), err.decode()


async def python_generation(addr: str, **kwargs) -> tuple[str, list[int], int]:
    responses = [r async for r in client.stream(addr, client.make_request(PROMPT, **kwargs), timeout_s=120)]
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids], responses[-1].finish_reason


@needs_node
async def test_documented_node_command_streams_the_same_text_as_python(gateway, node_command) -> None:
    text, ids, reason = await python_generation(gateway.addr, max_new_tokens=32)
    assert text
    code, out, err = await run_node(with_addr(node_command, gateway.addr))
    assert code == 0, err
    assert out == text                                       # streamed text, printed chunk by chunk
    assert f"[{len(ids)} tokens" in err and f"finish {client.finish_reason_words(reason)}]" in err


@needs_node
async def test_node_client_json_matches_python_token_ids(gateway, node_command) -> None:
    text, ids, _ = await python_generation(gateway.addr, max_new_tokens=32, ignore_eos=True, num_draft_tokens=3)
    assert len(ids) == 32 and text
    code, out, err = await run_node(with_addr(node_command, gateway.addr, "--ignore-eos", "--num-draft-tokens", "3",
                                              "--json"))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["text"] == text and summary["token_ids"] == ids
    assert summary["usage"]["completion_tokens"] == 32 and summary["usage"]["num_drafted_tokens"] > 0
    assert summary["finish_reason"] == "FINISH_REASON_LENGTH"


@needs_node
async def test_node_client_reports_invalid_argument(gateway, node_command) -> None:
    code, _, err = await run_node(with_addr(node_command, gateway.addr, "--temperature=-1"))
    assert code == 1 and err.startswith("error: INVALID_ARGUMENT: ")


# --------------------------------------------------------------------------- protoc: Go, C++, Java


def python_request_hex() -> str:
    return generate_pb2.GenerateRequest(prompt="def add(a, b):", max_new_tokens=32).SerializeToString().hex()


def skip_unless(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")


def test_documented_go_command_generates_stubs(tmp_path: Path) -> None:
    skip_unless("protoc-gen-go", "protoc-gen-go-grpc")
    result = run_documented(documented('mkdir -p "$OUT/go"'), tmp_path)
    assert result.returncode == 0, result.stderr
    generated = tmp_path / "go" / "protos" / "specmesh" / "v1"
    assert "package specmeshv1" in (generated / "generate.pb.go").read_text()
    assert "type GenerationClient interface" in (generated / "generate_grpc.pb.go").read_text()


CPP_MAIN = """#include <cstdio>
#include <cstdlib>
#include "protos/specmesh/v1/generate.pb.h"
int main(int argc, char** argv) {
  specmesh::v1::GenerateRequest request;
  request.set_prompt(argv[1]);
  request.set_max_new_tokens(std::atoi(argv[2]));
  for (unsigned char c : request.SerializeAsString()) std::printf("%02x", c);
  std::printf("\\n");
}
"""


def test_documented_cpp_command_generates_stubs_that_serialize_like_python(tmp_path: Path) -> None:
    skip_unless("protoc", "grpc_cpp_plugin")
    result = run_documented(documented('mkdir -p "$OUT/cpp"'), tmp_path)
    assert result.returncode == 0, result.stderr
    generated = tmp_path / "cpp" / "protos" / "specmesh" / "v1"
    assert (generated / "generate.grpc.pb.h").is_file() and (generated / "common.pb.cc").is_file()
    if shutil.which("g++") is None or not Path("/usr/include/google/protobuf/message.h").is_file():
        pytest.skip("generated only: g++ or the protobuf C++ headers (libprotobuf-dev) are missing")
    (tmp_path / "main.cc").write_text(CPP_MAIN)
    build = subprocess.run(["g++", "-std=c++17", "-O0", "-I", str(tmp_path / "cpp"), str(tmp_path / "main.cc"),
                            str(generated / "generate.pb.cc"), str(generated / "common.pb.cc"), "-lprotobuf",
                            "-o", str(tmp_path / "main")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    out = subprocess.run([str(tmp_path / "main"), "def add(a, b):", "32"], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == python_request_hex()


JAVA_MAIN = """import dev.specmesh.v1.GenerateRequest;
public class Main {
  public static void main(String[] args) {
    byte[] bytes = GenerateRequest.newBuilder().setPrompt(args[0]).setMaxNewTokens(Integer.parseInt(args[1]))
        .build().toByteArray();
    StringBuilder hex = new StringBuilder();
    for (byte b : bytes) hex.append(String.format("%02x", b));
    System.out.println(hex);
  }
}
"""


def protobuf_java_jar() -> Path | None:
    """The newest protobuf-java 4.x jar in the local Maven repository (offline), if any."""
    jars = sorted(Path.home().glob(".m2/repository/com/google/protobuf/protobuf-java/4.*/protobuf-java-4.*.jar"),
                  key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.name)])
    return jars[-1] if jars else None


def test_documented_java_command_generates_stubs_that_serialize_like_python(tmp_path: Path) -> None:
    skip_unless("protoc", "grpc_java_plugin")
    result = run_documented(documented('mkdir -p "$OUT/java"'), tmp_path)
    assert result.returncode == 0, result.stderr
    package = tmp_path / "java" / "dev" / "specmesh" / "v1"
    assert (package / "GenerationGrpc.java").is_file() and (package / "GenerateRequest.java").is_file()
    jar = protobuf_java_jar()
    if jar is None or shutil.which("javac") is None or shutil.which("java") is None:
        pytest.skip("generated only: javac/java or a protobuf-java 4.x jar in ~/.m2 is missing")
    (tmp_path / "Main.java").write_text(JAVA_MAIN)
    sources = [str(p) for p in package.glob("*.java") if not p.name.endswith("Grpc.java")]
    classes = tmp_path / "classes"
    build = subprocess.run(["javac", "-nowarn", "-d", str(classes), "-cp", str(jar), *sources,
                            str(tmp_path / "Main.java")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    out = subprocess.run(["java", "-cp", f"{jar}{os.pathsep}{classes}", "Main", "def add(a, b):", "32"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == python_request_hex(), out.stderr
