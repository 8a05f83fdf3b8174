"""The seed's declarative pipeline file: maps onto the same configuration as the equivalent flags, prints back to
itself, and reports mistakes with their line and column."""

from __future__ import annotations

from pathlib import Path

import pytest

from specmesh.config import DraftConfig, VerifierConfig, load_config
from specmesh.ops import cli
from specmesh.ops.pipeline_file import PipelineError, format_file, parse
from specmesh.ops.pipeline_map import generate_flags, request, resolve, service_flags, stack_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "pipelines"
SEED = '''model draft "qwen2.5-coder-0.5b" { device: cpu  max_batch: 8 }
model target "qwen2.5-coder-1.5b" { device: cpu  max_batch: 8 }
pipeline speculative { draft: draft  target: target  max_new_tokens: 256  speculative_factor: 2 }
run(prompt="def fibonacci(n):")
'''


def test_seed_file_equals_the_equivalent_flags() -> None:
    p = resolve(parse(SEED))
    assert p.verifier == load_config(VerifierConfig, "verifier", ["--model", "qwen2.5-coder-1.5b",
                                                                  "--max-num-seqs", "8"])
    assert p.draft == load_config(DraftConfig, "draft", ["--model", "qwen2.5-coder-0.5b", "--max-num-seqs", "8"])
    args = cli.build_parser().parse_args(["generate", "--max-new-tokens", "256", "--num-draft-tokens", "2",
                                          "def fibonacci(n):"])
    assert [request(r) for r in p.runs] == [cli.request_from_args(args)]


def test_stack_config_environment_gives_the_same_service_configs() -> None:
    p = resolve(parse((EXAMPLES / "tiny.pipeline").read_text()))
    stack = stack_config(p, gateway_port=56123)
    assert (stack.target, stack.draft, stack.gateway_port) == ("tiny-target", "tiny-draft", 56123)
    verifier_env = {**stack.extra_env, "SPECMESH_VERIFIER_MODEL": stack.target}   # what the launcher passes
    draft_env = {**stack.extra_env, "SPECMESH_DRAFT_MODEL": stack.draft}
    assert load_config(VerifierConfig, "verifier", [], env=verifier_env) == p.verifier
    assert load_config(DraftConfig, "draft", [], env=draft_env) == p.draft
    assert p.verifier.engine.kv_cache_memory_mb == 64 and p.draft.engine.max_num_seqs == 4


def test_generated_flags_round_trip_every_setting() -> None:
    source = SEED.replace('run(prompt="def fibonacci(n):")', 'run(prompt="-x \\"y\\"\\n", chat=true, temperature=0.5, '
                          'top_p=0.9, top_k=40, seed=7, stop="\\n\\n", ignore_eos=true, speculative_factor=0)')
    p = resolve(parse(source))
    run = p.runs[0]
    assert (run.prompt, run.max_new_tokens, run.speculative_factor) == ('-x "y"\n', 256, 0)
    args = cli.build_parser().parse_args(["generate", *generate_flags(run)])
    assert cli.request_from_args(args) == request(run)
    for config, cls, name in ((p.verifier, VerifierConfig, "verifier"), (p.draft, DraftConfig, "draft")):
        assert load_config(cls, name, service_flags(config)) == config


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.pipeline")), ids=lambda p: p.name)
def test_files_print_back_to_themselves(path: Path) -> None:
    pf = parse(path.read_text())
    text = format_file(pf)
    assert parse(text) == pf and format_file(parse(text)) == text
    resolve(pf)


ERRORS = [
    ('model draft qwen { }', 1, 13, "expected the model name in quotes"),
    ('model target "m" {\n  device: cpu\n  max_batch 8 }', 3, 13, "expected ':'"),
    ('model target "m" { device: cuda }', 1, 28, "device must be one of cpu"),
    ('model target "m" { max_batch: 0 }', 1, 31, "max_batch must be an integer >= 1"),
    ('model target "m" {\n    colour: red }', 2, 5, "unknown setting 'colour'"),
    (SEED.replace("target: target", "target: tagret"), 3, 46, "no model named 'tagret'"),
    (SEED.replace("max_new_tokens: 256", 'max_new_tokens: "256"'), 3, 70, "max_new_tokens must be an integer"),
    (SEED.replace('run(prompt="def fibonacci(n):")', 'run(prompt="x" max_new_tokens=3)'), 4, 16, "expected ','"),
    (SEED.replace('run(prompt="def fibonacci(n):")', 'run(promt="x")'), 4, 5, "unknown setting 'promt'"),
    (SEED + 'run(prompt="unterminated)\n', 5, 12, "unterminated string"),
    (SEED.replace("pipeline speculative", "pipeline eager"), 3, 10, "unknown pipeline type 'eager'"),
    (SEED + 'model draft "x" { }', 5, 7, "model 'draft' is defined twice"),
    ('model target "m" { }\npipeline speculative { target: target }', 2, 40, 'no run(prompt="...") statement'),
    ('model target "m" { a: 1 @ }', 1, 25, "unexpected character '@'"),
]


@pytest.mark.parametrize(("source", "line", "col", "message"), ERRORS)
def test_errors_name_line_and_column(source: str, line: int, col: int, message: str) -> None:
    with pytest.raises(PipelineError) as info:
        resolve(parse(source, filename="f.pipeline"))
    err = info.value
    assert (err.line, err.col) == (line, col), str(err)
    assert message in err.message
    assert str(err).startswith(f"f.pipeline:{line}:{col}: ")


def test_cli_run_dry_run_and_error_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", str(EXAMPLES / "qwen.pipeline"), "--dry-run", "--port", "56001"]) == 0
    out = capsys.readouterr().out
    assert "python -m verifier_service --model qwen2.5-coder-1.5b --max-num-seqs 8" in out
    assert "specmesh generate --addr 127.0.0.1:56001 --max-new-tokens 256" in out and "--chat" in out
    bad = tmp_path / "bad.pipeline"
    bad.write_text(SEED.replace("speculative_factor: 2", "speculative_factor: -2"))
    assert cli.main(["run", str(bad)]) == 2
    assert f"{bad}:3:95: speculative_factor must be an integer >= 0" in capsys.readouterr().err
