"""dtype "auto": the fastest batch-invariant numerics the CPU runs, said at start; a bad value is one line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from specmesh.config import DTYPE_CHOICES, DraftConfig, EngineConfig, VerifierConfig, load_config
from specmesh.engine.build import build_engine_parts
from specmesh.engine.dtype_choice import resolve_dtype
from specmesh.ops import cli, launcher
from tests.test_cli import free_ports

REAL = "qwen2.5-coder-1.5b"


def works(what: str):
    return lambda: what


def fails(why: str):
    def probe() -> str:
        raise RuntimeError(why)
    return probe


def never():
    def probe() -> str:
        raise AssertionError("probed although the choice was already made")
    return probe


def test_auto_takes_int4_where_its_kernel_builds() -> None:
    choice = resolve_dtype("auto", REAL, int4=works("AVX-512 VNNI"), int8=never())
    assert (choice.dtype, choice.reason) == ("int4", "auto: int4 kernel built for AVX-512 VNNI")
    assert choice.describe("verifier") == "verifier dtype int4 (auto: int4 kernel built for AVX-512 VNNI)"


def test_auto_falls_back_to_int8_then_float32_saying_why() -> None:
    choice = resolve_dtype("auto", REAL, int4=fails("int4_kernel.c needs a C compiler"), int8=works("fbgemm"))
    assert choice.dtype == "int8"
    assert "int4 kernel unavailable: int4_kernel.c needs a C compiler" in choice.reason and "fbgemm" in choice.reason
    choice = resolve_dtype("auto", REAL, int4=fails("needs a CPU with AVX2"), int8=fails("no quantized engine"))
    assert choice.dtype == "float32"
    assert "needs a CPU with AVX2" in choice.reason and "int8 unavailable: no quantized engine" in choice.reason


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_an_explicit_dtype_is_kept_without_probing(dtype: str) -> None:
    assert resolve_dtype(dtype, REAL, int4=never(), int8=never()).dtype == dtype


def test_tiny_presets_stay_float32_under_auto() -> None:
    for model in ("tiny-target", "tiny-draft", "tiny-draft-unrelated"):
        assert resolve_dtype("auto", model, int4=never(), int8=never()).dtype == "float32"


def test_the_service_logs_its_choice_at_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="specmesh.engine.build"):
        parts = build_engine_parts(EngineConfig(model="tiny-target", num_kv_blocks=8))
    assert not parts.runner.batch_invariant      # float32
    assert "tiny-target dtype float32 (auto: tiny random-weight model" in caplog.text


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specmesh.ops.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_a_bad_dtype_flag_is_one_line_naming_the_choices() -> None:
    for command in ("up", "demo"):
        result = _cli(command, "--dtype", "int5", *(["hello"] if command == "demo" else []))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0].startswith(f"error: specmesh {command}: argument --dtype") and "'int5'" in lines[0]
        assert all(choice in lines[0] for choice in DTYPE_CHOICES)


@pytest.mark.parametrize("service", ["VERIFIER", "DRAFT"])
def test_a_bad_dtype_env_var_is_one_line_naming_the_choices(service: str) -> None:
    result = _cli("up", env={f"SPECMESH_{service}_DTYPE": "int5"})
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: invalid value for SPECMESH_{service}_DTYPE: 'int5' (choose from "
                                     f"{', '.join(DTYPE_CHOICES)})")


def test_a_bad_dtype_is_one_line_for_a_service_run_alone() -> None:
    result = subprocess.run([sys.executable, "-m", "verifier_service", "--dtype", "int5"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: --dtype: 'int5' (choose from {', '.join(DTYPE_CHOICES)})"


class _Spawned:
    """Stands in for a child process: records its environment and exits at once."""
    envs: dict[str, dict[str, str]] = {}

    def __init__(self, cmd: list[str], env: dict[str, str], stdout: object) -> None:
        _Spawned.envs[cmd[-1]] = env
        self.stdout, self.pid, self.returncode = iter(()), 0, 1

    def poll(self) -> int:
        return 1

    def wait(self, timeout: float | None = None) -> int:
        return 1

    def send_signal(self, sig: int) -> None: ...

    kill = send_signal


@pytest.mark.parametrize(("flags", "env", "verifier", "draft"), [
    (["--dtype", "int8"], {}, "int8", "int8"),
    ([], {"SPECMESH_DRAFT_DTYPE": "int4"}, "float32", "int4"),          # tiny preset under auto: float32
    (["--dtype", "float32"], {"SPECMESH_VERIFIER_DTYPE": "int4"}, "float32", "float32"),  # the flag wins
])
def test_dtype_reaches_the_services_config(flags: list[str], env: dict[str, str], verifier: str, draft: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("SPECMESH_VERIFIER_DTYPE", "SPECMESH_DRAFT_DTYPE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ports = [str(p) for p in free_ports(3)]       # the port check runs first: never the (shared) defaults
    args = cli.build_parser().parse_args(["up", "--preset", "tiny", "--port", ports[0], "--verifier-port", ports[1],
                                          "--draft-port", ports[2], "--http-port", "0", *flags])
    config, said = cli._stack_config(args)
    said = "\n".join(said)
    assert f"verifier dtype {verifier} (" in said and f"draft dtype {draft} (" in said
    _Spawned.envs = {}
    monkeypatch.setattr(launcher.subprocess, "Popen", _Spawned)
    with pytest.raises(launcher.StartError):   # the stand-ins exit at once
        launcher.Stack(config, echo_output=False).start(timeout_s=5)
    children = _Spawned.envs
    assert load_config(VerifierConfig, "verifier", [], env=children["verifier_service"]).engine.dtype == verifier
    assert load_config(DraftConfig, "draft", [], env=children["draft_service"]).engine.dtype == draft
