"""`specmesh` command line: bring the stack up, stream a generation, fetch models, run a demo.

Errors are one line on stderr (`error: <what went wrong>`) and a non-zero exit code; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from typing import NoReturn

import grpc

from specmesh import __version__
from specmesh.config import DTYPE_CHOICES, DraftConfig, GatewayConfig, VerifierConfig, load_config
from specmesh.engine.dtype_choice import DtypeChoice, resolve_dtype
from specmesh.models.catalog import ModelRefError, check_model_ref
from specmesh.models.commands import add_models_parser
from specmesh.ops import client
from specmesh.ops.cli_output import CliError, print_stream
from specmesh.ops.launcher import PRESETS, PortInUseError, Stack, StackConfig, StartError
from specmesh.ops.pipeline_cli import add_run_parser
from specmesh.ops.warmup import DEFAULT_WARMUP_TOKENS, warm_up

DEFAULT_TRACE_FILE = os.path.join(tempfile.gettempdir(), "specmesh-spans.jsonl")
PORT_FLAGS = {"verifier": "--verifier-port", "draft": "--draft-port", "gateway": "--port",
              "gateway HTTP": "--http-port", "gateway metrics": "--metrics-port",
              "verifier metrics": "--metrics-port", "draft metrics": "--metrics-port"}


class OneLineParser(argparse.ArgumentParser):
    """Usage errors are one line too (`error: specmesh up: argument --dtype: invalid choice: ...`), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _stack_config(args: argparse.Namespace) -> tuple[StackConfig, list[str]]:
    """The stack to start, and the numerics each model service will run with and why (to say at start)."""
    target, draft = PRESETS[args.preset]
    target, draft = args.target or target, "" if args.no_draft else (args.draft or draft)
    for ref in (target, draft):
        if ref:
            check_model_ref(ref)
    trace = args.trace if args.trace is not None else bool(args.trace_file)
    trace_file = (args.trace_file or DEFAULT_TRACE_FILE) if trace else ""
    dtypes = _dtypes(args.dtype, target, draft)
    return StackConfig(target=target, draft=draft, host=args.host, gateway_port=args.port,
                       verifier_port=args.verifier_port, draft_port=args.draft_port, num_threads=args.threads,
                       http_port=args.http_port, metrics_port=args.metrics_port, trace_file=trace_file,
                       extra_env=_telemetry_env(args.metrics_port, trace_file),
                       verifier_dtype=dtypes["verifier"].dtype,
                       draft_dtype=dtypes["draft"].dtype if draft else ""), [c.describe(w) for w, c in dtypes.items()]


def _dtypes(flag: str | None, target: str, draft: str) -> dict[str, DtypeChoice]:
    """The numerics of verifier and draft service (--dtype, else each one's SPECMESH_*_DTYPE, else auto), resolved
    here once, so `up` and `demo` can say them: `verifier dtype int4 (auto: int4 kernel built for AVX-512 VNNI)`."""
    requested = {"verifier": flag or load_config(VerifierConfig, "verifier").engine.dtype,
                 "draft": flag or load_config(DraftConfig, "draft").engine.dtype}
    chosen = {"verifier": resolve_dtype(requested["verifier"], target)}
    if draft:
        chosen["draft"] = resolve_dtype(requested["draft"], draft)
    return chosen


def _telemetry_env(metrics_port: int, trace_file: str) -> dict[str, str]:
    """What `up` opens is exactly what its flags say: no per-service leftovers from the environment."""
    env = {}
    for service in ("GATEWAY", "VERIFIER", "DRAFT"):
        if not metrics_port:
            env[f"SPECMESH_{service}_METRICS_PORT"] = "0"
        if not trace_file:
            env[f"SPECMESH_{service}_TRACE_FILE"] = ""
    return env


def _add_stack_args(p: argparse.ArgumentParser) -> None:
    gateway, verifier, draft = (load_config(GatewayConfig, "gateway"), load_config(VerifierConfig, "verifier"),
                                load_config(DraftConfig, "draft"))
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="model pair: tiny (random weights, instant) or qwen (real offline Qwen2.5-Coder 1.5B/0.5B, "
                        "`specmesh models fetch` first)")
    p.add_argument("--target", default="", help="target model reference (overrides the preset; "
                   "`specmesh models list` shows the presets)")
    p.add_argument("--draft", default="", help="draft model reference (overrides the preset)")
    p.add_argument("--no-draft", action="store_true", help="run without a draft service (target-only)")
    p.add_argument("--host", default=gateway.host,
                   help="address every service listens on (env SPECMESH_GATEWAY_HOST; default %(default)s)")
    p.add_argument("--port", type=int, default=gateway.port,
                   help="gateway gRPC port (env SPECMESH_GATEWAY_PORT; default %(default)s)")
    p.add_argument("--http-port", type=int, default=gateway.http_port,
                   help="gateway OpenAI-compatible HTTP port, 0 = off (env SPECMESH_GATEWAY_HTTP_PORT; "
                        "default %(default)s)")
    p.add_argument("--verifier-port", type=int, default=verifier.port,
                   help="verifier gRPC port (env SPECMESH_VERIFIER_PORT; default %(default)s)")
    p.add_argument("--draft-port", type=int, default=draft.port,
                   help="draft service gRPC port (env SPECMESH_DRAFT_PORT; default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=gateway.telemetry.metrics_port,
                   help="Prometheus /metrics: gateway on N, verifier on N+1, draft on N+2; 0 = off "
                        "(env SPECMESH_GATEWAY_METRICS_PORT; default %(default)s)")
    p.add_argument("--trace", action=argparse.BooleanOptionalAction, default=None,
                   help="write every service's spans to one JSON-lines file (`specmesh trace show --file ...`); "
                        "default: on when --trace-file or SPECMESH_GATEWAY_TRACE_FILE is given")
    p.add_argument("--trace-file", default=gateway.telemetry.trace_file,
                   help=f"the span file; implies --trace (env SPECMESH_GATEWAY_TRACE_FILE; default "
                        f"{DEFAULT_TRACE_FILE})")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per model service (default %(default)s); the verifier's steps still run on "
                        "every core the stack may use unless SPECMESH_VERIFIER_NUM_THREADS_MAX says otherwise")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="numerics of both model services: auto = the fastest batch-invariant kind this CPU runs (int4 "
                        "where its kernel builds, else int8, else float32; float32 for the tiny presets); int4, int8 "
                        "and float32 all keep greedy speculation exact (env SPECMESH_VERIFIER_DTYPE / "
                        f"SPECMESH_DRAFT_DTYPE; default {verifier.engine.dtype})")


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message (chat template)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 = sampling")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling mass in (0, 1]; 0 = off")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed, prompt, parameters, models and numerics give the same "
                        "tokens, whatever the draft length (0 included), drafts, load or timing")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top token's "
                   "probability; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalise tokens already in the context (> 1 discourages repeats); 1 = off")
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="stop before this string (repeatable; it is never returned)")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="draft length per round; 0 = target-only (default: the server's)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def request_from_args(args: argparse.Namespace) -> client.generate_pb2.GenerateRequest:
    return client.make_request(
        "" if args.chat else args.prompt, messages=[("user", args.prompt)] if args.chat else (),
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop, num_draft_tokens=args.num_draft_tokens, ignore_eos=args.ignore_eos,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty)


def cmd_generate(args: argparse.Namespace) -> int:
    return asyncio.run(print_stream(args.addr, request_from_args(args)))


def _start(stack: Stack) -> None:
    try:
        stack.start()
    except PortInUseError as exc:
        raise CliError(f"{exc} (stop what holds it, or choose another port with {PORT_FLAGS[exc.what]})") from exc


def _print_up(stack: Stack) -> None:
    pids = {name: proc.pid for name, proc in stack.procs.items()}
    print(f"specmesh is up: verifier {stack.config.target}, draft {stack.config.draft or 'off'} (Ctrl-C to stop)")
    for what, where in stack.config.endpoints():
        pid = pids.get(what.split()[0]) if what.endswith("gRPC") else None
        print(f"  {what + ':':<24} {where}" + (f"  (pid {pid})" if pid else ""))
    print(f"try: specmesh generate --addr {stack.config.gateway_addr} \"def fibonacci(n):\"", flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    config, dtypes = _stack_config(args)
    print("\n".join(dtypes), flush=True)
    stack = Stack(config)
    _start(stack)
    if args.warmup_tokens > 0:
        print(warm_up(config.gateway_addr, args.warmup_tokens), flush=True)
    _print_up(stack)
    stopped = False

    def _stop(*_: object) -> None:
        nonlocal stopped
        stopped = True

    # Handlers for both: a process started in the background by a non-interactive shell inherits SIGINT ignored.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    while not stopped and not stack.exited():
        time.sleep(0.5)
    died = stack.exited()
    stack.stop()
    if died and not stopped:
        name, code = next(iter(died.items()))
        raise CliError(f"{name} exited with code {code}; stopped the other services")
    print("specmesh stopped", flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.preset == "qwen" and not (args.target or args.draft):
        from specmesh.models.real_pair import fetch_real_pair

        fetch_real_pair()
    config, dtypes = _stack_config(args)
    stack = Stack(config)
    print(f"starting verifier ({stack.config.target}), draft ({stack.config.draft or 'off'}) and gateway...",
          *dtypes, sep="\n", file=sys.stderr, flush=True)
    _start(stack)
    try:
        return asyncio.run(print_stream(stack.config.gateway_addr, request_from_args(args)))
    finally:
        stack.stop()


def cmd_trace(args: argparse.Namespace) -> int:
    from specmesh.telemetry import trace_store, waterfall

    try:
        if args.jaeger:
            trace_id = args.trace_id or trace_store.jaeger_last_trace_id(args.jaeger, args.service)
            own, linked = trace_store.fetch_jaeger(args.jaeger, trace_id), list[trace_store.Span]()
        else:
            spans = trace_store.load_file(args.file)
            trace_id = args.trace_id or trace_store.last_trace_id(spans)
            own, linked = trace_store.select_trace(spans, trace_id)
        print(waterfall.render(own, linked, width=args.width))
    except (LookupError, OSError) as exc:
        raise CliError(f"specmesh trace: {_os_error_text(exc)}") from exc
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
    parser = OneLineParser(prog="specmesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"specmesh {__version__}")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser("up", help="run verifier, draft service and gateway until Ctrl-C",
                        description="Checks every port is free, starts verifier, draft service and gateway, waits "
                                    "until each of its own processes is serving, prints every endpoint, and runs "
                                    "until Ctrl-C / SIGTERM. Flags default to the SPECMESH_* variables named below.")
    _add_stack_args(up)
    up.add_argument("--warmup-tokens", type=int, default=DEFAULT_WARMUP_TOKENS,
                    help="tokens of each of the two generations (greedy, then sampled) run through the stack before it "
                         "says it is up, so the first client's request does not pay a fresh stack's one-off costs; 0 = "
                         "none (default %(default)s)")
    up.set_defaults(func=cmd_up)
    gen = sub.add_parser("generate", help="stream a generation from a running gateway")
    gen.add_argument("--addr", default="127.0.0.1:50051", help="gateway address host:port (default %(default)s)")
    _add_generate_args(gen)
    gen.set_defaults(func=cmd_generate)
    demo = sub.add_parser("demo", help="bring the stack up, stream one generation, shut down")
    _add_stack_args(demo)
    _add_generate_args(demo)
    demo.set_defaults(func=cmd_demo)
    add_models_parser(sub)
    _add_trace_parser(sub)
    add_run_parser(sub)
    for subparser in sub.choices.values():
        subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                               help="show Python tracebacks instead of one-line errors")
    return parser


def _os_error_text(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or exc}: {exc.filename}"
    return str(exc)


def error_text(exc: BaseException) -> str:
    """The one line shown for an error (without the `error: ` prefix)."""
    if isinstance(exc, (CliError, ModelRefError, StartError)):
        return str(exc)
    if isinstance(exc, grpc.RpcError):
        return client.describe_rpc_error(exc, "the server")
    if isinstance(exc, (OSError, ValueError, LookupError, RuntimeError, TimeoutError)):
        return _os_error_text(exc)
    return f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)"


def _fail(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        return _fail("interrupted", 130)
    except Exception as exc:  # noqa: BLE001 -- one line for the user; --debug keeps the traceback
        if args.debug:
            raise
        return _fail(error_text(exc))


if __name__ == "__main__":
    sys.exit(main())
