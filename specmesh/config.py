"""Service configuration: frozen dataclasses built once at start-up. Environment variables are read here only
(`environment()`: the services' settings, the model cache, the C compiler); every other module asks a function below.

Every field can be set with an environment variable `SPECMESH_<SERVICE>_<FIELD>` (e.g. `SPECMESH_VERIFIER_PORT`)
or a command-line flag of the same name (`--port`); flags win over the environment, which wins over defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NoReturn, TypeVar, get_type_hints

T = TypeVar("T")

AUTO_DTYPE = "auto"
DTYPE_CHOICES = (AUTO_DTYPE, "int4", "int8", "float32", "bfloat16", "float16")
"""auto: the fastest batch-invariant numerics the CPU runs (specmesh/engine/dtype_choice.py); int4, int8, float32
keep greedy speculation exact; bfloat16 / float16 are not batch-invariant (README: numerics)."""
CHOICES: dict[str, tuple[str, ...]] = {"dtype": DTYPE_CHOICES}
"""Fields whose value must be one of a few names, checked where the value is read (env or flag)."""

CACHE_DIR_ENV = "SPECMESH_CACHE_DIR"
"""Where models, tokenizers and built kernels are cached (unset or empty: ~/.cache/specmesh)."""


def environment() -> Mapping[str, str]:
    """The process environment: the one place specmesh reads it. `load_config` reads SPECMESH_<SERVICE>_<FIELD>
    through it; the model cache and the kernel builder read theirs through the functions below."""
    return os.environ


def env_setting(name: str) -> str:
    """One environment variable's value; "" when unset."""
    return environment().get(name, "")


def cache_dir_setting() -> str:
    """$SPECMESH_CACHE_DIR as set ("" when unset or empty)."""
    return env_setting(CACHE_DIR_ENV)


def default_cache_dir() -> Path:
    """``$SPECMESH_CACHE_DIR`` if set, else ``~/.cache/specmesh``."""
    env = cache_dir_setting()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specmesh"


def c_compiler_setting() -> str:
    """$CC: the C compiler that builds the CPU kernels ("" = gcc or cc from PATH)."""
    return env_setting("CC")


@dataclass(frozen=True)
class TelemetryConfig:
    otlp_endpoint: str = ""            # e.g. "http://jaeger:4317"; empty = no OTLP export
    trace_file: str = ""               # JSON-lines span file used when no OTLP endpoint is set ("" = off)
    metrics_port: int = 0              # Prometheus /metrics port; 0 = off


@dataclass(frozen=True)
class TlsConfig:
    """gRPC transport security (PEM file paths; make a local CA with deploy/make_certs.sh)."""
    tls_cert: str = ""                 # this service's certificate chain; "" = plaintext gRPC
    tls_key: str = ""                  # its private key
    tls_client_ca: str = ""            # require client certificates signed by this CA (mutual TLS); "" = none
    tls_ca: str = ""                   # CA of the specmesh services this one calls; "" = plaintext to them
    tls_client_cert: str = ""          # certificate this service presents to them (mutual TLS)
    tls_client_key: str = ""
    tls_allowed_peers: str = ""        # verifier, draft: comma-separated CN/SAN names allowed to call (e.g. "gateway")


@dataclass(frozen=True)
class InputLimits:
    """Every cap on what a caller may send, in one table (README "Input limits"). Nested in each service's config,
    so each reads SPECMESH_<SERVICE>_<FIELD> (e.g. SPECMESH_GATEWAY_MAX_PROMPT_CHARS). Over a cap: INVALID_ARGUMENT
    (HTTP 400) naming the field and the cap; a body or gRPC message over max_body_bytes: HTTP 413 /
    RESOURCE_EXHAUSTED. Checked by specmesh/rpc/limits.py (the gateway's public API, the verifier / draft servicers)."""
    max_body_bytes: int = 2 * 2**20          # HTTP request body, and a public gRPC message of the gateway
    max_prompt_chars: int = 200_000          # prompt (also /v1/tokenize), and all chat messages' content together
    max_messages: int = 256                  # chat messages in one request (also /v1/tokenize)
    max_stop_strings: int = 16               # stop strings per request
    max_stop_string_len: int = 256           # characters of one stop string
    max_new_tokens_limit: int = 4096         # max_new_tokens (max_tokens) of one request
    max_request_id_len: int = 128            # characters of request_id
    max_concurrent_tokenize: int = 4         # /v1/tokenize calls tokenizing at once (more wait): bounds the RSS
    max_token_ids: int = 131_072             # token ids in one internal call (StartSession's prompt, Propose's
                                             # new_token_ids, a Verify's draft_dists entries together)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny-target"         # HF directory, .gguf file, or a preset (see `specmesh models list`)
    dtype: str = AUTO_DTYPE            # auto (int4, else int8, else float32), int4, int8 or float32: all exact
    forward: str = "specmesh"          # "specmesh": its own Qwen2 forward where it applies; "transformers": theirs
    num_threads: int = 1               # torch threads for this service
    num_threads_max: int = 0           # > num_threads: steps of >= max_threads_min_tokens tokens use this many threads
    max_threads_min_tokens: int = 8    # 1 = every step (a verifier sharing its host with an idle draft service)
    block_size: int = 16               # tokens per KV block
    kv_cache_memory_mb: int = 512      # KV pool budget (the CPU analogue of --gpu-memory-utilization)
    kv_cache_dtype: str = "auto"       # KV cache elements: float16 (half the bytes of float32: twice the tokens in the
                                       # budget, half the reads), float32, or auto (float16 for int8 / int4 models
                                       # where the attention kernel runs, else the model's dtype)
    num_kv_blocks: int = 0             # exact pool size in blocks; 0 = derive from kv_cache_memory_mb
    max_num_batched_tokens: int = 512  # token budget of one forward (chunked prefill beyond it)
    step_cost_factor: float = 2.0      # a step carrying decodes costs <= this x its decodes alone (measured); 0 = off
    min_prefill_tokens: int = 4        # prefill tokens a step may carry beside decodes whatever they cost
    max_num_seqs: int = 64             # sessions held at once
    max_queue_len: int = 256           # waiting work items before RESOURCE_EXHAUSTED
    max_model_len: int = 0             # 0 = the model's own context length
    cache_dir: str = ""                # model cache; "" = $SPECMESH_CACHE_DIR or ~/.cache/specmesh


@dataclass(frozen=True)
class VerifierConfig:
    host: str = "127.0.0.1"
    port: int = 50061
    engine: EngineConfig = EngineConfig()
    max_draft_tokens: int = 64         # draft tokens per Verify (more: INVALID_ARGUMENT)
    decode_ahead_tokens: int = 8       # idle sessions decode up to this many tokens ahead (decode_ahead.py); 0 = off
    decode_ahead_threads: int = 0      # torch threads of a step that only decodes ahead while a draft is made (1
                                       # beside a one-thread draft service: its core stays free); 0 = as any step
    decode_ahead_guesses: bool = True  # steps that decode ahead fill their free rows with prompt-lookup guesses
    decode_ahead_beside_drafts: bool = True   # a session whose caller drafted with the model in one of its last two
                                              # verifies decodes ahead too (false where the draft service shares the
                                              # verifier's cores: it gets every one of them while it drafts)
    batch_gather_ms: float = 20.0      # wait up to this (and 15% of the last forward) for the sessions it answered,
                                       # so concurrent streams share forwards (verifier_service/gather.py); 0 = off
    session_lease_s: float = 60.0      # no call for this long: the session is ended and its KV freed (> draft timeout)
    tenant_reserve_sessions: int = 16  # the last this many session slots only go to tenants that hold none
    warmup_tokens: int = 0             # one greedy session of this many tokens through the engine before health says
                                       # SERVING (verifier_service/warmup.py); 0 = none (the deploy files set 16)
    limits: InputLimits = InputLimits()
    telemetry: TelemetryConfig = TelemetryConfig()
    tls: TlsConfig = TlsConfig()


@dataclass(frozen=True)
class DraftConfig:
    host: str = "127.0.0.1"
    port: int = 50062
    engine: EngineConfig = EngineConfig(model="tiny-draft", kv_cache_memory_mb=256)
    max_q_entries: int = 32            # sparse draft distribution size sent per drafted token
    max_draft_tokens: int = 16
    draft_ahead: bool = True           # keep drafting the next block while the verifier works
    guesses: bool = True               # greedy draft forwards carry prompt-lookup guesses (specmesh/engine/guesses.py)
    head_vocab: int = 0                # > 0: draft only from the first N token ids (+ special tokens); 0 = all
    max_catch_up_tokens: int = 512     # a session's Propose bringing up to this many tokens verified since its last
                                       # one is decode work, run before prompts, whole (0 = one KV block)
    session_lease_s: float = 60.0      # no call for this long: the session is ended and its KV freed (> draft timeout)
    warmup_tokens: int = 0             # one greedy session drafting this many tokens through the engine before health
                                       # says SERVING (draft_service/warmup.py); 0 = none (the deploy files set 16)
    limits: InputLimits = InputLimits()
    telemetry: TelemetryConfig = TelemetryConfig()
    tls: TlsConfig = TlsConfig()


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000                  # OpenAI-compatible HTTP API (gateway/openai_http.py); 0 = off
    api_keys: str = ""                     # comma-separated KEY or KEY:TENANT for `authorization: Bearer`; "" = open
    api_keys_file: str = ""                # file with one KEY, KEY:TENANT or KEY:TENANT:LIMITS per line
    tenant_max_streams: int = 0            # generations a tenant may have open at once (own limits win); 0 = any
    tenant_max_queued_tokens: int = 0      # prompt + max_new_tokens of a tenant's open generations; 0 = any
    tenant_tokens_per_s: int = 0           # prompt + max_new_tokens a tenant may start per second; 0 = any
    retry_after_s: float = 1.0             # retry hint of an overload refusal (Retry-After, grpc-retry-pushback-ms)
    # Verifier replicas: comma-separated host:port, and/or dns:///NAME:PORT entries re-resolved every
    # discovery_interval_s (each A record is a replica: a headless Service, Compose's service name). Placement picks
    # one per session (gateway/placement.py); a session moves to another when its replica goes away.
    verifier_addr: str = "127.0.0.1:50061"  # replicas: comma-separated host:port and/or dns:///NAME:PORT entries
    draft_addr: str = "127.0.0.1:50062"   # "" = no draft service (target-only); dns:///NAME:PORT as above
    discovery_interval_s: float = 5.0      # re-resolve dns:/// addresses this often
    max_failovers: int = 3                 # times one stream's verifier session may move to another replica
    placement: str = "prefix"              # new sessions: "prefix" (prompt prefix, then load), "least_loaded",
                                           # "round_robin" (gateway/placement.py)
    tokenizer: str = ""                    # model reference for the tokenizer; "" = the verifier's model
    num_draft_tokens: int = 4              # default draft length per round
    adaptive_draft_length: bool = False    # tiers: pick k per round from acceptance and measured costs (<= the
                                           # request's); suffix drafting chooses per round on its own
    learned_priors: bool = True            # new requests start from what ended ones measured (learned_priors.py)
    draft_prefetch: bool = False           # ask for the next block while the verifier works (hides the draft RTT);
                                           # off: with suffix drafting it made the choice pick the model less (eval)
    max_draft_tokens: int = 16             # largest per-request draft length accepted
    default_max_new_tokens: int = 256
    draft_timeout_s: float = 30.0          # a slower draft call falls back to target-only for a few rounds
    verifier_timeout_s: float = 120.0      # a Verify slower than this fails; StartSession: + 0.1 s a prompt token
    end_session_retry_s: float = 600.0     # a failed EndSession is retried with backoff up to this long
    session_keepalive_s: float = 0.0       # renew open streams' session leases this often; 0 = a third of the lease
    health_probe_interval_s: float = 1.0   # verifier health probes: pause between rounds of probes
    health_probe_timeout_s: float = 2.0    # a probe slower than this failed
    health_probe_failures: int = 2         # failed probes in a row before a replica counts as down
    warmup_tokens: int = 0                 # a greedy and a sampled generation this long through the gateway before
                                           # health says SERVING (gateway/server.py); 0 = none (`specmesh
                                           # up` warms its stack as a client; the deploy files set 16)
    cache_dir: str = ""
    enable_cache: bool = True              # draft cache tier (kvstore): in-process unless redis_url is set
    redis_url: str = ""                    # e.g. redis://redis:6379/0; "" = in-process cache
    redis_cluster: bool = False            # redis_url names a Redis Cluster node
    cache_secret: str = ""                 # HMAC key for cache key names; "" = random per process (no sharing)
    cache_encryption_key: str = ""         # key (hex or base64) sealing Redis values; "" = derived from the secret
    cache_scope: str = "tenant"            # "tenant" (x-specmesh-tenant metadata) or "shared" (opt-in)
    cache_ttl_s: float = 86_400.0
    cache_suffix_lens: str = "8,4,2"       # context suffix lengths keyed, longest looked up first
    cache_read_timeout_s: float = 0.05     # a slower cache read is a miss
    enable_ngram: bool = True              # prompt-lookup drafts from the request's own context
    ngram_sizes: str = "4,3"
    local_draft_tokens: int = 16           # longest cache / n-gram draft per round
    suffix_drafting: bool = True           # one suffix-tree proposer (gateway/proposers/suffix.py) replaces the
                                           # cache + n-gram tiers and picks each round's proposer, target-only
                                           # included, by expected tokens per second (the held-out set's best)
    draft_tree_width: int = 0              # alternatives per low-confidence draft position (token trees); 0 = chains
    draft_host_share: float = 0.0          # the verifier's compute a running draft model takes from it: 0 = the draft
                                           # service has its own host; `specmesh up` sets draft threads / verifier
                                           # cores (suffix drafting prices the other streams' loss by it)
    overlap: bool = False                  # overlapped speculation (draft ahead of verdicts); off until measured
    limits: InputLimits = InputLimits()    # caps on every input (README "Input limits")
    telemetry: TelemetryConfig = TelemetryConfig()
    tls: TlsConfig = TlsConfig()


def _convert(value: str, typ: Any, leaf: str = "") -> Any:
    if typ is bool:
        return value.lower() in ("1", "true", "yes", "on")
    if leaf in CHOICES and value not in CHOICES[leaf]:
        raise ValueError(f"choose from {', '.join(CHOICES[leaf])}")
    return typ(value)


def config_error(message: str) -> NoReturn:
    """A bad setting: one line on stderr, exit code 2 (as for a bad flag), no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _flat_fields(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted name, type) of every leaf field; nested dataclasses are flattened without their own prefix."""
    hints = get_type_hints(cls)
    out: list[tuple[str, Any]] = []
    for f in fields(cls):
        typ = hints[f.name]
        if isinstance(typ, type) and dataclasses.is_dataclass(typ):
            out.extend((f"{f.name}.{name}", t) for name, t in _flat_fields(typ))
        else:
            out.append((f.name, typ))
    return out


def _build(cls: type[T], values: Mapping[str, Any], base: T) -> T:
    changes: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        current = getattr(base, f.name)
        if dataclasses.is_dataclass(current):
            nested = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(f.name + ".")}
            changes[f.name] = _build(type(current), nested, current)
        elif f.name in values:
            changes[f.name] = values[f.name]
    return dataclasses.replace(base, **changes)  # type: ignore[type-var]


SERVICE_MODULES = {"verifier": "verifier_service", "draft": "draft_service", "gateway": "gateway"}


def _dotted_value(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def load_config(cls: type[T], service: str, argv: Sequence[str] | None = None,
                env: Mapping[str, str] | None = None, base: T | None = None) -> T:
    """Defaults <- SPECMESH_<SERVICE>_<FIELD> environment <- --field command-line flags."""
    env = environment() if env is None else env
    base = cls() if base is None else base
    from specmesh.config_help import flag_help

    parser = argparse.ArgumentParser(
        prog=f"python -m {SERVICE_MODULES.get(service, service)}",
        description=f"Runs the specmesh {service}. Every flag is also the environment variable named in its help; "
                    "flags win over the environment, which wins over the defaults shown.")
    values: dict[str, Any] = {}
    types = dict(_flat_fields(cls))
    for dotted, typ in types.items():
        leaf = dotted.rsplit(".", 1)[-1]
        env_name = f"SPECMESH_{service.upper()}_{leaf.upper()}"
        if env_name in env:
            try:
                values[dotted] = _convert(env[env_name], typ, leaf)
            except ValueError as exc:
                config_error(f"invalid value for {env_name}: {env[env_name]!r} ({exc})")
        parser.add_argument(f"--{leaf.replace('_', '-')}", dest=dotted, default=None,
                            metavar="0|1" if typ is bool else "|".join(CHOICES.get(leaf, ())) or leaf.upper(),
                            help=flag_help(cls, dotted, env_name, _dotted_value(base, dotted)))
    if argv is not None:
        for dotted, raw in vars(parser.parse_args(list(argv))).items():
            if raw is not None:
                leaf = dotted.rsplit(".", 1)[-1]
                try:
                    values[dotted] = _convert(raw, types[dotted], leaf)
                except ValueError as exc:
                    config_error(f"--{leaf.replace('_', '-')}: {raw!r} ({exc})")
    return _build(cls, values, base)
