"""The benchmark tooling stands alone (its workload lives in the repository, a peer binary is found by flag, env or
PATH), and its workload splits into tuning and held-out evaluation prompts, reported apart."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bench import llamacpp_peer
from bench.common import DEFAULT_WORKLOAD, REPO_ROOT, SPLITS, RequestResult, load_workload
from bench.speedup_arms import ARM_ENV, BASE_ENV, DEFAULT_ARMS, REPEAT_ARMS, arm_k
from bench.speedup_split import split_goals, split_lines, summarize_splits
from specmesh.config import GatewayConfig


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


# ------------------------------------------------------------------------------------------------- tune / eval
def test_the_workload_holds_out_evaluation_prompts_unlike_the_tuning_ones() -> None:
    tune, held = (load_workload(DEFAULT_WORKLOAD, splits=[s]) for s in SPLITS)
    assert tune and held and len(tune) + len(held) == len(load_workload(DEFAULT_WORKLOAD))
    assert {p.split for p in tune} == {"tune"} and {p.split for p in held} == {"eval"}
    assert not {p.prompt for p in tune} & {p.prompt for p in held}
    assert not {p.system for p in tune if p.system} & {p.system for p in held if p.system}   # other FAQ persona
    assert {p.category for p in tune} <= {p.category for p in held}       # every tuned category is judged too
    assert {p.category for p in held} - {p.category for p in tune}        # and tasks nobody tuned on
    held_chat = [p.prompt for p in held if p.category == "chat"]
    assert sum(not p.isascii() for p in held_chat) >= 2                   # other languages
    assert [p.split for p in load_workload(DEFAULT_WORKLOAD, ["chat"], limit=1)] == ["tune", "eval"]


def test_an_unknown_split_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "w.jsonl"
    bad.write_text('{"id": "x", "category": "chat", "split": "test", "prompt": "hi"}\n')
    with pytest.raises(SystemExit, match="split 'test'; choose from tune, eval"):
        load_workload(str(bad))


def _r(pid: str, category: str, mode: str, decode_s: float, accepted: int = 0) -> RequestResult:
    # 11 tokens: the first at 0.1 s, 10 more in decode_s seconds
    return RequestResult(pid, category, mode, completion_tokens=11, wall_s=0.1 + decode_s, ttft_s=0.1,
                         num_rounds=10 - accepted, num_drafted=4 * (10 - accepted), num_accepted=accepted)


def test_speedup_reports_tuning_and_evaluation_prompts_apart_and_judges_the_defaults() -> None:
    split_of = {"t-chat": "tune", "t-code": "tune", "e-chat": "eval", "e-code": "eval"}
    runs = {"a/64": {
        "target": [_r(pid, pid.split("-")[1], "target", 1.0) for pid in split_of],
        "defaults": [_r("t-chat", "chat", "defaults", 0.5, 5), _r("t-code", "code", "defaults", 0.4, 6),
                     _r("e-chat", "chat", "defaults", 1.25, 1), _r("e-code", "code", "defaults", 0.5, 5)],
        "sequential": [_r(pid, pid.split("-")[1], "sequential", 0.2, 8) for pid in split_of],
    }}
    splits = summarize_splits(runs, split_of, 4)
    assert list(splits) == ["tune", "eval"]
    assert splits["eval"]["a/64"]["defaults"]["chat"]["speedup"]["decode_median"] == pytest.approx(0.8)
    assert splits["tune"]["a/64"]["defaults"]["chat"]["speedup"]["decode_median"] == pytest.approx(2.0)
    assert splits["eval"]["a/64"]["target"]["overall"]["n"] == 2
    goals = {g["goal"]: g for g in split_goals(splits)}
    # the defaults arm is judged, not the faster sequential one; chat loses on the held-out prompts only
    assert not goals["[eval] @64 chat decode speedup, layout a, defaults"]["passed"]
    assert goals["[eval] @64 code decode speedup, layout a, defaults"]["passed"]
    overall = goals["[eval] @64 overall decode speedup, layout a, defaults"]
    assert overall["threshold"] == 1.3 and overall["value"] == pytest.approx((0.8 + 2.0) / 2)
    assert all(g["passed"] for name, g in goals.items() if name.startswith("[tune]"))
    text = "\n".join(split_lines(splits))
    assert "[eval a/64]" in text and "defaults     chat 0.80x | code 2.00x | overall 1.40x" in text
    without_defaults = {"a/64": {arm: rs for arm, rs in runs["a/64"].items() if arm != "defaults"}}
    assert {g["goal"].rsplit(", ", 1)[1] for g in split_goals(summarize_splits(without_defaults, split_of, 4))} \
        == {"sequential"}


def test_the_defaults_arm_runs_the_gateway_as_it_ships() -> None:
    config = GatewayConfig()
    env = ARM_ENV["defaults"]
    assert set(env) == set(BASE_ENV)
    assert env["SPECMESH_GATEWAY_ENABLE_NGRAM"] == ("1" if config.enable_ngram else "0")
    assert env["SPECMESH_GATEWAY_ADAPTIVE_DRAFT_LENGTH"] == ("1" if config.adaptive_draft_length else "0")
    assert arm_k("defaults", 3, 6) is None       # its requests leave the draft length to the gateway
    assert "defaults" in DEFAULT_ARMS and "defaults" in REPEAT_ARMS
