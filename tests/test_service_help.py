"""`python -m gateway|verifier_service|draft_service --help`: every flag says what it means, its variable and its
default."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specmesh.config import DraftConfig, GatewayConfig, VerifierConfig, _flat_fields, load_config
from specmesh.config_help import field_comments, field_help, flag_help

SERVICES = [(GatewayConfig, "gateway", "gateway"), (VerifierConfig, "verifier", "verifier_service"),
            (DraftConfig, "draft", "draft_service")]


@pytest.mark.parametrize(("cls", "service", "module"), SERVICES)
def test_every_field_has_a_meaning(cls: type, service: str, module: str) -> None:
    undocumented = [dotted for dotted, _ in _flat_fields(cls) if len(field_help(cls, dotted).split()) < 2]
    assert undocumented == []


@pytest.mark.parametrize(("cls", "service", "module"), SERVICES)
def test_help_lists_every_flag_with_its_env_and_default(cls: type, service: str, module: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        load_config(cls, service, ["--help"], env={})
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())       # argparse wraps lines
    assert text.startswith(f"usage: python -m {module}")
    for dotted, _ in _flat_fields(cls):
        leaf = dotted.rsplit(".", 1)[-1]
        assert f"--{leaf.replace('_', '-')}" in text
        assert f"(env SPECMESH_{service.upper()}_{leaf.upper()}; default " in text, dotted


def test_gateway_help_in_a_subprocess_gives_meaning_and_default() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway", "--help"], capture_output=True, text=True,
                         timeout=120).stdout
    text = " ".join(out.split())
    assert "--verifier-addr" in text and "comma-separated host:port and/or dns:///NAME:PORT" in text
    assert "(env SPECMESH_GATEWAY_VERIFIER_ADDR; default \"127.0.0.1:50061\")" in text
    assert "--enable-cache 0|1" in text and "(env SPECMESH_GATEWAY_ENABLE_CACHE; default 1)" in text


def test_field_comments_follow_continuation_lines_and_escape_percent() -> None:
    comments = field_comments(VerifierConfig)
    assert comments["decode_ahead_threads"].endswith("0 = as any step")       # two comment lines joined
    assert "its core stays free" in comments["decode_ahead_threads"]
    assert flag_help(GatewayConfig, "port", "E", 5) == "gRPC port to listen on (env E; default 5)"
    assert "%%" in flag_help(GatewayConfig, "port", "E", "100%")              # argparse formats help with %
