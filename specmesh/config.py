"""Service configuration: frozen dataclasses built once at start-up. Environment variables are read here only.

Every field can be set with an environment variable `SPECMESH_<SERVICE>_<FIELD>` (e.g. `SPECMESH_VERIFIER_PORT`)
or a command-line flag of the same name (`--port`); flags win over the environment, which wins over defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")


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
class EngineConfig:
    model: str = "tiny-target"         # HF directory, .gguf file, or a preset (see `specmesh models list`)
    dtype: str = "float32"             # float32, int8 or int4: each keeps greedy speculation exact (README: numerics)
    forward: str = "specmesh"          # "specmesh": its own Qwen2 forward where it applies; "transformers": theirs
    num_threads: int = 1               # torch threads for this service
    num_threads_max: int = 0           # > num_threads: steps of >= max_threads_min_tokens tokens use this many threads
    max_threads_min_tokens: int = 8    # 1 = every step (a verifier sharing its host with an idle draft service)
    block_size: int = 16               # tokens per KV block
    kv_cache_memory_mb: int = 512      # KV pool budget (the CPU analogue of --gpu-memory-utilization)
    num_kv_blocks: int = 0             # exact pool size in blocks; 0 = derive from kv_cache_memory_mb
    max_num_batched_tokens: int = 512  # token budget of one forward (chunked prefill beyond it)
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
    decode_ahead_tokens: int = 8       # greedy sessions decode up to this many tokens ahead while idle; 0 = off
    decode_ahead_threads: int = 0      # torch threads of a step that only decodes ahead (1 on a host shared with the
                                       # draft service: its core stays free); 0 = as any step
    decode_ahead_guesses: bool = True  # steps that decode ahead fill their free rows with prompt-lookup guesses
    session_lease_s: float = 60.0      # no call for this long: the session is ended and its KV freed (> draft timeout)
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
    guesses: bool = True               # greedy draft forwards carry prompt-lookup guesses (specmesh/guesses.py)
    head_vocab: int = 0                # > 0: draft only from the first N token ids (+ special tokens); 0 = all
    session_lease_s: float = 60.0      # no call for this long: the session is ended and its KV freed (> draft timeout)
    telemetry: TelemetryConfig = TelemetryConfig()
    tls: TlsConfig = TlsConfig()


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 0                     # OpenAI-compatible HTTP API (gateway/openai_http.py); 0 = off
    api_keys: str = ""                     # comma-separated KEY or KEY:TENANT for `authorization: Bearer`; "" = open
    api_keys_file: str = ""                # file with one KEY or KEY:TENANT per line (e.g. a mounted secret)
    # Verifier replicas: comma-separated host:port, and/or dns:///NAME:PORT entries re-resolved every
    # discovery_interval_s (each A record is a replica: a headless Service, Compose's service name). Placement picks
    # one per session (gateway/placement.py); a session moves to another when its replica goes away.
    verifier_addr: str = "127.0.0.1:50061"
    draft_addr: str = "127.0.0.1:50062"   # "" = no draft service (target-only); dns:///NAME:PORT as above
    discovery_interval_s: float = 5.0      # re-resolve dns:/// addresses this often
    max_failovers: int = 3                 # times one stream's verifier session may move to another replica
    placement: str = "prefix"              # new sessions: "prefix" (prompt prefix, then load), "least_loaded",
                                           # "round_robin" (gateway/placement.py)
    tokenizer: str = ""                    # model reference for the tokenizer; "" = the verifier's model
    num_draft_tokens: int = 4              # default draft length per round
    adaptive_draft_length: bool = True     # pick k per round from acceptance and measured costs (<= the request's)
    learned_priors: bool = True            # new requests start from what ended ones measured (learned_priors.py)
    draft_prefetch: bool = True            # ask for the next block while the verifier works (hides the draft RTT)
    max_draft_tokens: int = 16             # largest per-request draft length accepted
    default_max_new_tokens: int = 256
    max_new_tokens_limit: int = 4096
    max_prompt_chars: int = 200_000
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    draft_timeout_s: float = 30.0          # a slower draft call falls back to target-only for a few rounds
    verifier_timeout_s: float = 120.0
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
    suffix_drafting: bool = False          # one suffix-tree proposer (gateway/suffix_drafter.py) replaces the
                                           # cache + n-gram tiers; its shared store uses the cache settings above
    draft_tree_width: int = 0              # alternatives per low-confidence draft position (token trees); 0 = chains
    overlap: bool = False                  # overlapped speculation (draft ahead of verdicts); off until measured
    telemetry: TelemetryConfig = TelemetryConfig()
    tls: TlsConfig = TlsConfig()


def _convert(value: str, typ: Any) -> Any:
    if typ is bool:
        return value.lower() in ("1", "true", "yes", "on")
    return typ(value)


def _flat_fields(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted name, type) of every leaf field; nested dataclasses are flattened without their own prefix."""
    hints = get_type_hints(cls)
    out: list[tuple[str, Any]] = []
    for f in fields(cls):
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
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


def load_config(cls: type[T], service: str, argv: Sequence[str] | None = None,
                env: Mapping[str, str] | None = None, base: T | None = None) -> T:
    """Defaults <- SPECMESH_<SERVICE>_<FIELD> environment <- --field command-line flags."""
    env = os.environ if env is None else env
    base = cls() if base is None else base
    parser = argparse.ArgumentParser(prog=f"specmesh {service}")
    values: dict[str, Any] = {}
    types = dict(_flat_fields(cls))
    for dotted, typ in types.items():
        leaf = dotted.rsplit(".", 1)[-1]
        env_name = f"SPECMESH_{service.upper()}_{leaf.upper()}"
        if env_name in env:
            try:
                values[dotted] = _convert(env[env_name], typ)
            except ValueError as exc:
                raise SystemExit(f"invalid value for {env_name}: {env[env_name]!r} ({exc})") from None
        parser.add_argument(f"--{leaf.replace('_', '-')}", dest=dotted, default=None, help=f"env {env_name}")
    if argv is not None:
        for dotted, raw in vars(parser.parse_args(list(argv))).items():
            if raw is not None:
                try:
                    values[dotted] = _convert(raw, types[dotted])
                except ValueError as exc:
                    parser.error(f"--{dotted.rsplit('.', 1)[-1]}: {exc}")
    return _build(cls, values, base)
