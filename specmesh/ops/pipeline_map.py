"""Meaning of a pipeline file: its blocks mapped onto the normal configuration (VerifierConfig / DraftConfig, the
launcher's StackConfig) and onto request parameters, plus the equivalent command-line flags.

    model <role> "<name>" { device: cpu  max_batch: 8  dtype: float32  kv_cache_mb: 512  block_size: 16 }
    pipeline speculative { draft: <role>  target: <role>  max_new_tokens: 256  speculative_factor: 2
                           temperature: 0  top_p: 1  top_k: 0  seed: 7  stop: "\\n\\n"  ignore_eos: false }
    run(prompt="...", chat=false, <any pipeline sampling setting as a per-run override>)

max_batch -> EngineConfig.max_num_seqs (sessions batched together), speculative_factor -> the request's
num_draft_tokens (draft tokens verified per round; 0 = target-only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protos.specmesh.v1 import generate_pb2
from specmesh.config import DTYPE_CHOICES, DraftConfig, VerifierConfig, _flat_fields
from specmesh.ops import client
from specmesh.ops.launcher import StackConfig
from specmesh.ops.pipeline_file import Block, Entry, PipelineFile

LAUNCHER_FIELDS = {"model", "host", "port", "num_threads"}   # StackConfig sets these itself


def _int(lo: int) -> Callable[[Any], str | None]:
    return lambda v: None if isinstance(v, int) and not isinstance(v, bool) and v >= lo else f"an integer >= {lo}"


def _float(lo: float, hi: float | None = None) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        ok = isinstance(v, int | float) and not isinstance(v, bool) and lo <= v and (hi is None or v <= hi)
        return None if ok else f"a number in [{lo}, {hi if hi is not None else 'inf'}]"
    return check


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else "one of " + ", ".join(choices)


def _typed(kind: type, name: str) -> Callable[[Any], str | None]:
    return lambda v: None if isinstance(v, kind) else name


MODEL_KEYS: dict[str, tuple[str | None, Callable[[Any], str | None]]] = {   # key -> (EngineConfig field, check)
    "device": (None, _one_of("cpu")),
    "max_batch": ("max_num_seqs", _int(1)),
    "dtype": ("dtype", _one_of(*DTYPE_CHOICES)),
    "kv_cache_mb": ("kv_cache_memory_mb", _int(1)),
    "block_size": ("block_size", _int(1)),
    "max_model_len": ("max_model_len", _int(0)),
}
SAMPLING_KEYS: dict[str, Callable[[Any], str | None]] = {
    "max_new_tokens": _int(1), "speculative_factor": _int(0), "temperature": _float(0.0),
    "top_p": _float(0.0, 1.0), "top_k": _int(0), "seed": _int(0), "stop": _typed(str, "a string"),
    "ignore_eos": _typed(bool, "true or false"),
}
PIPELINE_KEYS = {"draft": _typed(str, "a model role"), "target": _typed(str, "a model role"), **SAMPLING_KEYS}
RUN_KEYS = {"prompt": _typed(str, "a string"), "chat": _typed(bool, "true or false"), **SAMPLING_KEYS}


@dataclass(frozen=True)
class RunParams:
    prompt: str
    chat: bool = False
    max_new_tokens: int = 64
    speculative_factor: int | None = None
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int | None = None
    stop: str | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class Pipeline:
    verifier: VerifierConfig
    draft: DraftConfig | None
    runs: tuple[RunParams, ...]


def _check(pf: PipelineFile, block: Block, schema: dict[str, Callable[[Any], str | None]], where: str) -> None:
    for e in block.entries:
        if e.key not in schema:
            raise pf.error(f"unknown setting {e.key!r} in {where}; known: {', '.join(schema)}", e.key_pos)
        problem = schema[e.key](e.value)
        if problem:
            raise pf.error(f"{e.key} must be {problem}, not {e.value!r}", e.value_pos)


def _engine(block: Block, base: Any) -> Any:
    changes: dict[str, Any] = {field: e.value for e in block.entries if (field := MODEL_KEYS[e.key][0])}
    engine = dataclasses.replace(base.engine, model=block.name, **changes)
    return dataclasses.replace(base, engine=engine)


def _model_ref(pf: PipelineFile, models: dict[str, Block], entry: Entry | None, role: str, pos: tuple[int, int]
               ) -> Block | None:
    if entry is None:
        if role == "target":
            raise pf.error("pipeline needs a target: model", pos)
        return None
    if entry.value not in models:
        raise pf.error(f"no model named {entry.value!r} (defined: {', '.join(models) or 'none'})", entry.value_pos)
    return models[str(entry.value)]


def _blocks(pf: PipelineFile) -> tuple[dict[str, Block], Block, list[Block]]:
    models: dict[str, Block] = {}
    pipelines = [b for b in pf.blocks if b.kind == "pipeline"]
    for b in pf.blocks:
        if b.kind == "model":
            if b.label in models:
                raise pf.error(f"model {b.label!r} is defined twice", b.label_pos)
            models[b.label] = b
    if not pipelines:
        raise pf.error("no pipeline block (pipeline speculative { ... })", (1, 1))
    if len(pipelines) > 1:
        raise pf.error("only one pipeline block is allowed", pipelines[1].pos)
    if pipelines[0].label != "speculative":
        raise pf.error(f"unknown pipeline type {pipelines[0].label!r}; known: speculative", pipelines[0].label_pos)
    runs = [b for b in pf.blocks if b.kind == "run"]
    if not runs:
        lines = pf.source.splitlines() or [""]
        raise pf.error('no run(prompt="...") statement', (len(lines), len(lines[-1]) + 1))
    return models, pipelines[0], runs


def _run(pf: PipelineFile, pipeline: Block, run: Block) -> RunParams:
    if run.get("prompt") is None:
        raise pf.error('run(...) needs prompt="..."', run.pos)
    values: dict[str, Any] = {e.key: e.value for e in pipeline.entries if e.key in SAMPLING_KEYS}
    values.update({e.key: e.value for e in run.entries})
    return RunParams(**values)


def resolve(pf: PipelineFile) -> Pipeline:
    """Check the file's meaning and map it; errors carry the offending line and column."""
    model_keys = {k: check for k, (_, check) in MODEL_KEYS.items()}
    for b in pf.blocks:                       # settings first, in file order, then the structure
        schema, where = {"model": (model_keys, f"model {b.label!r}"), "pipeline": (PIPELINE_KEYS, "pipeline"),
                         "run": (RUN_KEYS, "run(...)")}[b.kind]
        _check(pf, b, schema, where)
    models, pipeline, runs = _blocks(pf)
    target = _model_ref(pf, models, pipeline.get("target"), "target", pipeline.pos)
    draft = _model_ref(pf, models, pipeline.get("draft"), "draft", pipeline.pos)
    assert target is not None
    verifier = _engine(target, VerifierConfig())
    draft_config = _engine(draft, DraftConfig()) if draft is not None else None
    return Pipeline(verifier, draft_config, tuple(_run(pf, pipeline, r) for r in runs))


def _changed(config: Any) -> list[tuple[str, Any]]:
    """(leaf field, value) of every leaf that differs from the dataclass's defaults."""
    default, out = type(config)(), []
    for dotted, _ in _flat_fields(type(config)):
        value = config
        base = default
        for part in dotted.split("."):
            value, base = getattr(value, part), getattr(base, part)
        if value != base:
            out.append((dotted.rsplit(".", 1)[-1], value))
    return out


def service_flags(config: VerifierConfig | DraftConfig) -> list[str]:
    """`python -m verifier_service|draft_service` flags that give exactly this config."""
    changed = [(leaf, value) for leaf, value in _changed(config) if leaf != "model"]
    return ["--model", config.engine.model,
            *[arg for leaf, value in changed for arg in (f"--{leaf.replace('_', '-')}", str(value))]]


def stack_config(p: Pipeline, **overrides: Any) -> StackConfig:
    """The launcher's view: model names plus SPECMESH_* environment for every other changed setting."""
    env = {f"SPECMESH_VERIFIER_{leaf.upper()}": str(v) for leaf, v in _changed(p.verifier) if leaf not in
           LAUNCHER_FIELDS}
    if p.draft is not None:
        env |= {f"SPECMESH_DRAFT_{leaf.upper()}": str(v) for leaf, v in _changed(p.draft) if leaf not in
                LAUNCHER_FIELDS}
    return StackConfig(target=p.verifier.engine.model, draft=p.draft.engine.model if p.draft else "",
                       extra_env=env, **overrides)


def request(run: RunParams) -> generate_pb2.GenerateRequest:
    return client.make_request(
        "" if run.chat else run.prompt, messages=[("user", run.prompt)] if run.chat else (),
        max_new_tokens=run.max_new_tokens, temperature=run.temperature, top_p=run.top_p, top_k=run.top_k,
        seed=run.seed, stop=[run.stop] if run.stop is not None else [], num_draft_tokens=run.speculative_factor,
        ignore_eos=run.ignore_eos)


def generate_flags(run: RunParams) -> list[str]:
    """`specmesh generate` arguments that send exactly request(run)."""
    flags = ["--max-new-tokens", str(run.max_new_tokens), "--temperature", str(run.temperature),
             "--top-p", str(run.top_p), "--top-k", str(run.top_k)]
    optional = [("--seed", run.seed), ("--stop", run.stop), ("--num-draft-tokens", run.speculative_factor)]
    flags += [arg for name, value in optional if value is not None for arg in (name, str(value))]
    flags += ["--chat"] * run.chat + ["--ignore-eos"] * run.ignore_eos
    return [*flags, "--", run.prompt]
