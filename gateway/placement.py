"""Which verifier replica a new session goes to: where its prompt's first KV block is likely cached, unless that
replica is overloaded; else the least loaded. Pure logic over what the replicas report (no I/O, no clock).

Prefix affinity is rendezvous (highest-random-weight) hashing of the prompt's first full KV block of tokens: every
gateway ranks the replicas the same way for the same block, so requests sharing a system prompt meet on one replica
(its prefix cache then holds the block), and adding or removing a replica moves only the prefixes that ranked it
first. Prompts shorter than a block have nothing cacheable in common: they go to the least loaded replica.

Load is what a replica reported last (queued work, sessions it holds, free KV blocks: on every VerifyResponse and
in ModelInfo) plus the sessions this gateway opened on it since (reports lag behind a burst of new requests).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 16           # the engine's default; a replica's ModelInfo says its own
OVERLOAD_SLACK = 4                # sessions (or queued items) more than the least loaded replica: overloaded
MIN_FREE_KV_FRACTION = 0.1        # fewer free KV blocks than this share of the pool: overloaded


@dataclass(frozen=True)
class ReplicaView:
    """One replica as placement sees it."""
    name: str                     # stable across gateways (its address): the rendezvous key
    usable: bool = True           # answers health probes, not draining, still discovered
    num_waiting: int = 0          # work items queued on it (reported)
    num_sessions: int = 0         # sessions it holds (reported, plus this gateway's opened since)
    num_free_kv_blocks: int = 0
    num_kv_blocks: int = 0        # 0: not reported yet (KV never counts as full)

    @property
    def load(self) -> int:
        return self.num_sessions + self.num_waiting

    @property
    def kv_full(self) -> bool:
        return self.num_kv_blocks > 0 and self.num_free_kv_blocks < MIN_FREE_KV_FRACTION * self.num_kv_blocks


def prefix_key(prompt_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> bytes | None:
    """The prompt's first full KV block as bytes (None: shorter than a block). A block is the unit the verifier's
    prefix cache shares; the last prompt token is never cached alone, so a block needs one token after it."""
    if block_size <= 0 or len(prompt_ids) <= block_size:
        return None
    return b",".join(str(t).encode() for t in prompt_ids[:block_size])


def rendezvous_rank(key: bytes, names: Sequence[str]) -> list[str]:
    """Names by descending hash(key, name): the first is the key's home."""
    def weight(name: str) -> bytes:
        return hashlib.blake2b(key + b"|" + name.encode(), digest_size=8).digest()
    return sorted(names, key=weight, reverse=True)


def overloaded(replica: ReplicaView, least_load: int) -> bool:
    return replica.kv_full or replica.load > least_load + OVERLOAD_SLACK


POLICIES = ("prefix", "least_loaded", "round_robin")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"placement must be one of {', '.join(POLICIES)}; got {policy!r}")
    return policy


def place(prompt_ids: Sequence[int], replicas: Sequence[ReplicaView], block_size: int = DEFAULT_BLOCK_SIZE,
          tie_break: int = 0, policy: str = "prefix") -> list[str]:
    """Usable replicas in the order to try: the prefix's home (the highest-ranked replica that is not overloaded)
    first when the prompt has a full block, then by load (ties rotated by `tie_break`, e.g. a request counter, so
    equal replicas share a burst). Unusable replicas are left out. policy "least_loaded" skips the prefix,
    "round_robin" (the old behaviour, for comparison) ignores load too: replicas in turn from `tie_break`."""
    usable = [r for r in replicas if r.usable]
    if not usable:
        return []
    n = len(usable)
    if policy == "round_robin":
        return [usable[(tie_break + i) % n].name for i in range(n)]
    by_load = sorted(range(n), key=lambda i: (usable[i].kv_full, usable[i].load, (i - tie_break) % n))
    order = [usable[i].name for i in by_load]
    key = prefix_key(prompt_ids, block_size) if policy == "prefix" else None
    if key is None:
        return order
    least = min(r.load for r in usable)
    views = {r.name: r for r in usable}
    for name in rendezvous_rank(key, list(views)):
        if not overloaded(views[name], least):
            return [name, *(o for o in order if o != name)]
    return order
