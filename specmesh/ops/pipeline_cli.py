"""`specmesh run FILE`: bring the stack up as the pipeline file describes, run each run(...) and shut down."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

from specmesh.ops.cli_output import print_stream
from specmesh.ops.launcher import Stack, StackConfig
from specmesh.ops.pipeline_file import PipelineError, parse
from specmesh.ops.pipeline_map import Pipeline, generate_flags, request, resolve, service_flags, stack_config


def load_pipeline(path: str) -> Pipeline:
    return resolve(parse(Path(path).read_text(encoding="utf-8"), filename=path))


def describe(p: Pipeline, config: StackConfig) -> str:
    """The equivalent plain commands (services with flags, then one `specmesh generate` per run)."""
    host = config.host
    lines = ["# equivalent commands:",
             shlex.join(["python", "-m", "verifier_service", *service_flags(p.verifier), "--host", host,
                         "--port", str(config.verifier_port), "--num-threads", str(config.num_threads)])]
    if p.draft is not None:
        lines.append(shlex.join(["python", "-m", "draft_service", *service_flags(p.draft), "--host", host,
                                 "--port", str(config.draft_port), "--num-threads", str(config.num_threads)]))
    lines.append(shlex.join(["python", "-m", "gateway", "--host", host, "--port", str(config.gateway_port),
                             "--verifier-addr", f"{host}:{config.verifier_port}",
                             "--draft-addr", f"{host}:{config.draft_port}" if p.draft else ""]))
    lines += [shlex.join(["specmesh", "generate", "--addr", config.gateway_addr, *generate_flags(run)])
              for run in p.runs]
    return "\n".join(lines)


def _fetch_real_models(config: StackConfig) -> None:
    from specmesh import models

    for ref in (config.target, config.draft):
        if ref in models.REAL_PRESETS:
            models.fetch_model(ref)


def cmd_run(args: argparse.Namespace) -> int:
    try:
        pipeline = load_pipeline(args.file)
    except (PipelineError, OSError) as exc:
        print(f"specmesh run: {exc}", file=sys.stderr)
        return 2
    config = stack_config(pipeline, gateway_port=args.port, num_threads=args.threads)
    if args.dry_run:
        print(describe(pipeline, config))
        return 0
    _fetch_real_models(config)
    stack = Stack(config)
    print(f"starting verifier ({config.target}), draft ({config.draft or 'off'}) and gateway...", file=sys.stderr,
          flush=True)
    stack.start()
    try:
        for run in pipeline.runs:
            asyncio.run(print_stream(config.gateway_addr, request(run)))
    finally:
        stack.stop()
    return 0


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a declarative pipeline file (model / pipeline / run(...) statements)")
    p.add_argument("file", help="the pipeline file")
    p.add_argument("--port", type=int, default=50051, help="gateway port")
    p.add_argument("--threads", type=int, default=1, help="torch threads per model service")
    p.add_argument("--dry-run", action="store_true", help="print the equivalent commands and start nothing")
    p.set_defaults(func=cmd_run)
