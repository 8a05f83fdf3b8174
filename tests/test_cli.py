"""The `specmesh` command line as a user meets it: one-line errors with exit codes, `up` that never claims a port it
does not hold and prints every endpoint it opened, `models list / fetch` that say what is in the cache."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from specmesh import __version__
from specmesh.config import GatewayConfig, load_config
from specmesh.models import real_pair
from specmesh.models.catalog import check_model_ref
from specmesh.ops import cli, client
from specmesh.ops.launcher import ChildOutput, Stack, StartError, port_is_free, wait_child_ready
from specmesh.ops.warmup import warm_up

PROMPT = "def fibonacci(n):"


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specmesh.ops.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one error line, got:\n{stderr}"
    assert lines[0].startswith("error: ")
    return lines[0]


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"specmesh {__version__}"


def _parsers(parser: argparse.ArgumentParser, name: str = "specmesh") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_flag_of_every_subcommand_has_help() -> None:
    missing = [f"{name}: {action.option_strings or action.dest}"
               for name, parser in _parsers(cli.build_parser()) for action in parser._actions
               if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()]
    assert missing == []


def test_up_help_names_the_env_vars() -> None:
    text = run_cli("up", "--help").stdout
    for flag, env in [("--port", "SPECMESH_GATEWAY_PORT"), ("--http-port", "SPECMESH_GATEWAY_HTTP_PORT"),
                      ("--verifier-port", "SPECMESH_VERIFIER_PORT"), ("--draft-port", "SPECMESH_DRAFT_PORT"),
                      ("--metrics-port", "SPECMESH_GATEWAY_METRICS_PORT"), ("--host", "SPECMESH_GATEWAY_HOST"),
                      ("--trace-file", "SPECMESH_GATEWAY_TRACE_FILE"), ("--no-trace", "")]:
        assert flag in text and env.replace("_", "") in text.replace("\n", "").replace(" ", "").replace("_", "")


def test_generate_without_a_server_is_one_line_unavailable() -> None:
    (port,) = free_ports(1)
    result = run_cli("generate", "--addr", f"127.0.0.1:{port}", PROMPT, timeout=60)
    assert result.returncode == 1
    assert error_line(result.stderr) == (f"error: UNAVAILABLE: cannot reach the gateway at 127.0.0.1:{port} "
                                         "(is 'specmesh up' running?)")


def test_debug_shows_the_traceback() -> None:
    (port,) = free_ports(1)
    result = run_cli("--debug", "generate", "--addr", f"127.0.0.1:{port}", PROMPT, timeout=60)
    assert result.returncode != 0 and "Traceback (most recent call last)" in result.stderr


def test_unknown_model_reference_names_the_presets() -> None:
    result = run_cli("up", "--target", "no-such-model", timeout=60)
    assert result.returncode == 1
    line = error_line(result.stderr)
    assert "unknown model reference 'no-such-model'" in line
    assert all(p in line for p in ("tiny-target", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))


def test_real_preset_not_fetched_says_to_fetch(tmp_path: Path) -> None:
    result = run_cli("demo", "--preset", "tiny", "--target", "qwen2.5-coder-1.5b", PROMPT,
                     env={"SPECMESH_CACHE_DIR": str(tmp_path)}, timeout=60)
    assert result.returncode == 1
    assert "is not fetched" in error_line(result.stderr) and "`specmesh models fetch`" in result.stderr
    assert not (tmp_path / "gguf").exists()


def test_missing_model_path_and_missing_trace_file(tmp_path: Path) -> None:
    result = run_cli("up", "--draft", str(tmp_path / "nowhere"), timeout=60)
    assert result.returncode == 1
    assert error_line(result.stderr) == f"error: model path {tmp_path / 'nowhere'} does not exist"
    result = run_cli("trace", "show", "--file", str(tmp_path / "spans.jsonl"), timeout=60)
    assert result.returncode == 1 and "No such file or directory" in error_line(result.stderr)


def test_up_refuses_a_held_verifier_port_before_starting_anything() -> None:
    gateway_port, draft_port = free_ports(2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_cli("up", "--preset", "tiny", "--port", str(gateway_port), "--draft-port", str(draft_port),
                         "--verifier-port", str(port), timeout=60)
    assert result.returncode == 1
    assert error_line(result.stderr) == (f"error: port {port} (verifier) is already in use on 127.0.0.1 "
                                         "(stop what holds it, or choose another port with --verifier-port)")
    # No service was started: none printed a ready line, and none logged to the (inherited) stderr, which holds
    # exactly the one error line.
    assert "specmesh is up" not in result.stdout and "ready:" not in result.stdout


def test_the_http_api_is_on_by_default_on_8000_and_0_turns_it_off() -> None:
    assert load_config(GatewayConfig, "gateway", [], env={}).http_port == 8000
    assert load_config(GatewayConfig, "gateway", ["--http-port", "0"], env={}).http_port == 0
    config, _ = cli._stack_config(cli.build_parser().parse_args(["up", "--preset", "tiny"]))
    assert config.http_port == 8000 and ("gateway HTTP", 8000) in config.ports()
    assert ("OpenAI-compatible HTTP", "http://127.0.0.1:8000/v1") in config.endpoints()
    off, _ = cli._stack_config(cli.build_parser().parse_args(["up", "--preset", "tiny", "--http-port", "0"]))
    assert "gateway HTTP" not in dict(off.ports())
    # a stack started from code (benchmarks, tests) opens no HTTP port unless asked: its gateway is told 0
    assert Stack(off)._telemetry_env("gateway", http=True)["SPECMESH_GATEWAY_HTTP_PORT"] == "0"


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


def test_a_child_must_print_its_own_ready_line_for_its_port() -> None:
    proc = _child("import time; print('ready: specmesh.v1.Verifier on 127.0.0.1:1234', flush=True); time.sleep(30)")
    try:
        with pytest.raises(StartError, match="serving on port 1234, expected 4321"):
            wait_child_ready("verifier", proc, ChildOutput(proc, echo=False), 4321, 20)
    finally:
        proc.kill()
        proc.wait()
    proc = _child("import sys; sys.exit(3)")
    with pytest.raises(StartError, match=r"verifier \(pid \d+\) exited with code 3 before it was ready"):
        wait_child_ready("verifier", proc, ChildOutput(proc, echo=False), 4321, 20)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_rpc_errors_name_the_status_code_and_blame_the_right_hop() -> None:
    refused = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: Connection refused"
    assert client.describe_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, refused), "h:1") == (
        "UNAVAILABLE: cannot reach the gateway at h:1 (is 'specmesh up' running?)")
    relayed = f"verifier: {refused}"          # the gateway is up; its verifier is not
    assert client.describe_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, relayed), "h:1") == (
        f"UNAVAILABLE: {relayed}")
    assert client.describe_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"), "h:1") == (
        "RESOURCE_EXHAUSTED: queue full")


def test_finish_reasons_in_words() -> None:
    words = [client.finish_reason_words(v) for v in range(1, 5)]
    assert words == ["length", "stop", "stop string", "context"]


def _fake_converted(cache: Path, preset: str, size: int) -> Path:
    out = real_pair.converted_dir(cache, preset)
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"\0" * size)
    (out / real_pair.MARKER_NAME).write_text("done\n")
    return out


def test_models_list_and_fetch_say_what_is_in_the_cache(tmp_path: Path) -> None:
    env = {"SPECMESH_CACHE_DIR": str(tmp_path)}
    draft_dir = _fake_converted(tmp_path, "qwen2.5-coder-0.5b", 2_500_000)
    listing = run_cli("models", "list", env=env).stdout.splitlines()
    rows = {line.split()[0]: line for line in listing[1:-1]}
    assert set(rows) == {"tiny-target", "tiny-draft", "tiny-draft-unrelated", "qwen2.5-coder-1.5b",
                         "qwen2.5-coder-0.5b"}
    assert rows["qwen2.5-coder-0.5b"].split()[1:5] == ["real", "fetched", "2.5", "MB"]
    assert rows["qwen2.5-coder-0.5b"].endswith(str(draft_dir))
    assert rows["qwen2.5-coder-1.5b"].split()[1:4] == ["real", "missing", "-"]
    assert "run `specmesh models fetch`" in rows["qwen2.5-coder-1.5b"]
    assert listing[-1].startswith(f"model cache: {tmp_path}")
    target_dir = _fake_converted(tmp_path, "qwen2.5-coder-1.5b", 1000)
    result = run_cli("models", "fetch", env=env)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [f"already fetched: qwen2.5-coder-0.5b {draft_dir} (2.5 MB)",
                                          f"already fetched: qwen2.5-coder-1.5b {target_dir} (1.0 KB)"]


def test_check_model_ref_accepts_what_loads(tmp_path: Path) -> None:
    check_model_ref("tiny-draft")
    (tmp_path / "config.json").write_text("{}")
    check_model_ref(str(tmp_path))


# --------------------------------------------------------------------------- a real `specmesh up` (tiny models)


def _read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"`specmesh up` ended early (code {proc.poll()}):\n{''.join(lines)}")
        lines.append(line.rstrip("\n"))
        if line.startswith(marker):
            return lines
    raise AssertionError(f"no {marker!r} line within {timeout_s} s:\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[str], dict[str, int], Path]]:
    names = ["port", "verifier-port", "draft-port", "http-port", "metrics-port"]
    ports = dict(zip(names, free_ports(5), strict=True))
    while not all(cli_port_free(ports["metrics-port"] + i) for i in range(3)):  # N, N+1, N+2 must be free
        (ports["metrics-port"],) = free_ports(1)
    trace_file = tmp_path_factory.mktemp("up") / "spans.jsonl"
    args = [a for name, port in ports.items() for a in (f"--{name}", str(port))]
    proc = subprocess.Popen([sys.executable, "-m", "specmesh.ops.cli", "up", "--preset", "tiny", *args,
                             "--trace-file", str(trace_file)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        yield proc, ports, trace_file
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def cli_port_free(port: int) -> bool:
    return port_is_free("127.0.0.1", port)


def test_up_prints_every_endpoint_serves_and_stops_on_sigint(up, capsys: pytest.CaptureFixture[str]) -> None:
    proc, ports, trace_file = up
    lines = _read_until(proc, "try: specmesh generate", timeout_s=600)
    text = "\n".join(lines)
    m = ports["metrics-port"]
    expected = {"gateway gRPC:": f"127.0.0.1:{ports['port']}", "verifier gRPC:": f"127.0.0.1:{ports['verifier-port']}",
                "draft gRPC:": f"127.0.0.1:{ports['draft-port']}",
                "OpenAI-compatible HTTP:": f"http://127.0.0.1:{ports['http-port']}/v1",
                "gateway metrics:": f"http://127.0.0.1:{m}/metrics",
                "verifier metrics:": f"http://127.0.0.1:{m + 1}/metrics",
                "draft metrics:": f"http://127.0.0.1:{m + 2}/metrics", "trace file:": str(trace_file)}
    for what, where in expected.items():
        assert any(line.strip().startswith(what) and where in line.split() for line in lines), (what, text)
    assert "specmesh is up" in text
    assert "warmed up: 32 tokens in " in text        # a greedy and a sampled generation ran before it said it was up
    assert "verifier dtype float32 (auto: tiny random-weight model" in text     # said at start, with the reason
    for port in (m, m + 1, m + 2):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert b"specmesh_" in reply.read()
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['http-port']}/v1/models", timeout=10) as reply:
        assert json.loads(reply.read())["data"]

    addr = f"127.0.0.1:{ports['port']}"
    assert cli.main(["generate", "--addr", addr, "--max-new-tokens", "8", "--ignore-eos", PROMPT]) == 0
    captured = capsys.readouterr()
    assert captured.out and "8 tokens" in captured.err and "finish length," in captured.err
    assert cli.main(["generate", "--addr", addr, "--temperature", "-1", PROMPT]) == 1
    line = error_line(capsys.readouterr().err)
    assert line.startswith("error: INVALID_ARGUMENT: ") and "temperature" in line

    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=150)   # each child drains up to 10 s; a stuck one is killed after 20 s
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"specmesh up did not stop within 150 s of SIGINT; its output ends with:\n{out[-4000:]}")
    assert proc.returncode == 0 and "specmesh stopped" in out
    assert trace_file.is_file() and trace_file.stat().st_size > 0
    assert all(cli_port_free(p) for p in (ports["port"], ports["verifier-port"], ports["draft-port"]))


def test_warm_up_reports_a_gateway_it_cannot_reach_instead_of_raising() -> None:
    (port,) = free_ports(1)
    line = warm_up(f"127.0.0.1:{port}", 4, timeout_s=10)
    assert line.startswith("warm-up skipped: UNAVAILABLE: cannot reach the gateway")
