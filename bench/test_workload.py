"""The benchmark tooling stands alone: its workload lives in the repository, a peer binary is found by flag, env or
PATH."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bench import llamacpp_peer
from bench.common import DEFAULT_WORKLOAD, REPO_ROOT, load_workload


def test_default_workload_is_the_repositorys_own_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing beside the working directory
    path = Path(DEFAULT_WORKLOAD)
    assert path.is_absolute() and path.is_relative_to(REPO_ROOT) and path.is_file()
    assert {p.category for p in load_workload(DEFAULT_WORKLOAD)} >= {"chat", "code", "summarize", "repeated"}


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_llama_server_from_flag_then_env_then_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bin").mkdir()
    on_path = _executable(tmp_path / "bin" / "llama-server")
    from_env = _executable(tmp_path / "env-server")
    from_flag = _executable(tmp_path / "flag-server")
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.delenv(llamacpp_peer.SERVER_ENV, raising=False)
    assert llamacpp_peer.server_path() == str(on_path)
    monkeypatch.setenv(llamacpp_peer.SERVER_ENV, str(from_env))
    assert llamacpp_peer.server_path() == str(from_env)
    assert llamacpp_peer.server_path(str(from_flag)) == str(from_flag)
    # an explicit choice that is not there is not replaced by another binary
    assert llamacpp_peer.server_path(str(tmp_path / "missing")) == ""
    monkeypatch.setenv(llamacpp_peer.SERVER_ENV, str(tmp_path / "missing"))
    assert llamacpp_peer.server_path() == ""


def test_missing_llama_server_is_one_error_naming_flag_env_and_path(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != llamacpp_peer.SERVER_ENV}
    env["PATH"] = str(tmp_path)  # no llama-server on it
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run([sys.executable, "-m", "bench.llamacpp_peer", "--limit", "1"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "--server" in last and llamacpp_peer.SERVER_ENV in last and "PATH" in last
    assert "Traceback" not in done.stderr
