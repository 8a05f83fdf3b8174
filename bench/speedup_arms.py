"""Arms and layouts of bench/speedup.py: which gateway settings each arm runs with, which feature it needs, where
each service runs. Pure (no models, no gRPC): testable in bench/test_bench.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Every gateway starts from BASE_ENV (draft model only, fixed k, prefetch on); an arm with its own settings gets its
# own gateway on the same verifier and draft service.
BASE_ENV = {"SPECMESH_GATEWAY_ENABLE_NGRAM": "0", "SPECMESH_GATEWAY_ENABLE_CACHE": "0",
            "SPECMESH_GATEWAY_ADAPTIVE_DRAFT_LENGTH": "0", "SPECMESH_GATEWAY_DRAFT_PREFETCH": "1",
            "SPECMESH_GATEWAY_SUFFIX_DRAFTING": "0"}
SEQUENTIAL = {"SPECMESH_GATEWAY_DRAFT_PREFETCH": "0"}
OVERLAP = {"SPECMESH_GATEWAY_OVERLAP": "1"}
TREE = {"SPECMESH_GATEWAY_DRAFT_TREE_WIDTH": "2"}
# the suffix-tree proposer replaces the cache + n-gram tiers: those tiers on, so the proposer is consulted
SUFFIX = {"SPECMESH_GATEWAY_SUFFIX_DRAFTING": "1", "SPECMESH_GATEWAY_ENABLE_NGRAM": "1",
          "SPECMESH_GATEWAY_ENABLE_CACHE": "1"}


def gateway_defaults() -> dict[str, str]:
    """BASE_ENV's settings at the gateway's own defaults: the drafting configuration a user gets out of the box."""
    from specmesh.config import GatewayConfig

    config = GatewayConfig()
    values = {key: getattr(config, key.removeprefix("SPECMESH_GATEWAY_").lower()) for key in BASE_ENV}
    return {key: ("1" if value else "0") if isinstance(value, bool) else str(value) for key, value in values.items()}


ARM_ENV: dict[str, dict[str, str]] = {
    "target": {}, "model": {},
    "defaults": gateway_defaults(),     # the gateway as it ships (tiers, adaptive k, prefetch as configured there)
    "tiers": {"SPECMESH_GATEWAY_ENABLE_NGRAM": "1", "SPECMESH_GATEWAY_ENABLE_CACHE": "1"},
    "adaptive": {"SPECMESH_GATEWAY_ADAPTIVE_DRAFT_LENGTH": "1"},
    # the same without the gateway's learned priors: every request learns its costs and acceptance from nothing
    "adaptive-cold": {"SPECMESH_GATEWAY_ADAPTIVE_DRAFT_LENGTH": "1", "SPECMESH_GATEWAY_LEARNED_PRIORS": "0"},
    "no-prefetch": SEQUENTIAL,
    "head-32k": {},
    # issue 14: sequential speculation, then each new feature alone on top of it, then all three together
    "sequential": SEQUENTIAL,
    "overlap": {**SEQUENTIAL, **OVERLAP},
    "tree": {**SEQUENTIAL, **TREE},
    "suffix": {**SEQUENTIAL, **SUFFIX},
    "all": {**SEQUENTIAL, **OVERLAP, **TREE, **SUFFIX},
    "suffix-cold": {**SEQUENTIAL, **SUFFIX, "SPECMESH_GATEWAY_LEARNED_PRIORS": "0"},
    # sequential at k = 4 whatever --num-draft-tokens is: 5 verified tokens, one past the int4 AVX2 kernel's row tile
    "sequential-k4": SEQUENTIAL,
}
# Arms whose requests ask for their own draft length (else --num-draft-tokens; adaptive arms: --adaptive-max-k).
ARM_K: dict[str, int] = {"sequential-k4": 4}
# Arms with a draft service of their own (same model, other settings), reached through a proxy of their own.
ARM_DRAFT_ENV: dict[str, dict[str, str]] = {"head-32k": {"SPECMESH_DRAFT_HEAD_VOCAB": "32768"}}
# Arms whose asks of a repeated (FAQ) prompt go `repeat` times under one tenant (their drafters learn across asks).
REPEAT_ARMS = ("tiers", "suffix", "all", "suffix-cold", "defaults")
# GatewayConfig fields an arm needs; without them the services ignore the env var and the arm would only repeat
# the sequential arm, so it is not run and is reported as n/a.
ARM_FEATURES: dict[str, tuple[str, ...]] = {
    "overlap": ("overlap",), "tree": ("draft_tree_width",), "suffix": ("suffix_drafting",),
    "all": ("overlap", "draft_tree_width", "suffix_drafting"),
    "adaptive-cold": ("learned_priors",), "suffix-cold": ("suffix_drafting", "learned_priors"),
}
STACK_ARMS = tuple(ARM_ENV)
DEFAULT_ARMS = ("target", "defaults", "sequential", "overlap", "tree", "suffix", "all")
SPEC_ARMS = tuple(a for a in STACK_ARMS if a != "target")


def missing_features(arm: str, config_fields: set[str]) -> list[str]:
    """GatewayConfig fields the arm needs that the gateway does not have."""
    return [f for f in ARM_FEATURES.get(arm, ()) if f not in config_fields]


def arm_k(arm: str, num_draft_tokens: int, adaptive_max_k: int) -> int | None:
    """The draft length an arm's requests ask for: 0 for target-only, None for `defaults` (a request that leaves it
    to the gateway, as a client does), an ARM_K arm's own, the adaptive arms' cap, else --num-draft-tokens."""
    if arm == "target":
        return 0
    if arm == "defaults":
        return None
    return ARM_K.get(arm) or (adaptive_max_k if arm.startswith("adaptive") else num_draft_tokens)


def layout_arms(wanted: list[str], fields: set[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Arms to run in a layout (target first) and the n/a ones with their missing GatewayConfig fields."""
    arms = ["target"] + [a for a in wanted if a != "target"]
    unknown = set(arms) - set(STACK_ARMS)
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}; choose from {STACK_ARMS}")
    na = {a: missing for a in arms if (missing := missing_features(a, fields))}
    return [a for a in arms if a not in na], na


def gateway_fields() -> set[str]:
    """Field names of the gateway's config, as the services read their env from it."""
    from specmesh.config import GatewayConfig

    return {f.name for f in dataclasses.fields(GatewayConfig)}


@dataclass(frozen=True)
class Layout:
    """Where the model services run. `pin`: service name -> `taskset -c` cpu list (unpinned when absent)."""
    name: str
    description: str
    verifier_threads: int
    draft_threads: int
    pin: tuple[tuple[str, str], ...] = ()
    peer_threads: int = 1           # threads of the peers (llama.cpp) that stand for this layout
    # `nice -n` per service: in layout a the model services stand for hosts of their own, so the gateway, the WAN
    # proxy and the client (other hosts, unpinned here) must not wait behind them for a core
    nice: tuple[tuple[str, int], ...] = ()
    # `taskset -c` cpu list of every gateway and of the benchmark's own process (the client and the WAN proxy); ""
    # = unpinned. In layout a they share the draft's core: unpinned, the kernel woke them on the verifier's core
    # now and then (next to the thread that answered them) and target-only swung between 4.9 and 8.2 tok/s.
    # Conservative for speculation: the draft model pays for their CPU, target-only does not.
    others_cpus: str = ""


LAYOUTS: dict[str, Layout] = {
    "a": Layout("a", "two hosts simulated: verifier on core 0, draft service on core 1 (1 thread each); "
                     "target-only = the verifier alone on its core; both services at nice 10, the gateways, "
                     "proxy and client pinned to the draft's core", 1, 1, (("verifier", "0"), ("draft", "1")), 1,
                (("verifier", 10), ("draft", 10)), "1"),
    "b": Layout("b", "one 2-core host: nothing pinned, verifier 2 threads (target-only uses both cores), "
                     "draft 1 thread", 2, 1, (), 2),
}


def run_key(layout: str, length: int) -> str:
    """Key of one (layout, max_new_tokens) run in the report, e.g. 'a/64'."""
    return f"{layout}/{length}"


def parse_run_key(key: str) -> tuple[str, int]:
    layout, _, length = key.partition("/")
    return layout, int(length)


def prompt_cap(length: int, lengths: list[int], limit: int, long_limit: int) -> int:
    """Prompts per category at this length: `limit` at the shortest length, `long_limit` (if set) at longer ones
    (0 = all)."""
    return long_limit if long_limit and length > min(lengths) else limit
