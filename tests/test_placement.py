"""Placement of new sessions on verifier replicas: prefix affinity by rendezvous hashing, load fallback."""

from __future__ import annotations

import pytest

from gateway.placement import OVERLOAD_SLACK, ReplicaView, place, prefix_key, rendezvous_rank
from gateway.server import build_gateway_parts
from specmesh.config import GatewayConfig
from specmesh.ops import client
from tests.stack import start_verifier

NAMES = ["10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"]
SYSTEM = list(range(100, 116))                      # one full 16-token block shared by every request


def views(**load: int) -> list[ReplicaView]:
    return [ReplicaView(name, num_sessions=load.get(f"r{i}", 0)) for i, name in enumerate(NAMES)]


def test_prefix_key_needs_a_full_block_and_one_token_after_it() -> None:
    assert prefix_key(SYSTEM) is None                            # the last prompt token is never cached alone
    assert prefix_key([*SYSTEM, 1]) == prefix_key([*SYSTEM, 2, 3])
    assert prefix_key([*SYSTEM, 1]) != prefix_key([7, *SYSTEM])


def test_shared_prefix_meets_on_one_replica_while_it_is_not_overloaded() -> None:
    home = rendezvous_rank(prefix_key([*SYSTEM, 0]), NAMES)[0]   # the same on every gateway: hashing, no state
    assert {place([*SYSTEM, user], views())[0] for user in range(20)} == {home}
    index = NAMES.index(home)
    busy = views(**{f"r{index}": OVERLOAD_SLACK})                # as loaded as allowed: still home
    assert place([*SYSTEM, 1], busy)[0] == home
    over = views(**{f"r{index}": OVERLOAD_SLACK + 1})            # overloaded: the next in rank, not the busy one
    assert place([*SYSTEM, 1], over)[0] == rendezvous_rank(prefix_key([*SYSTEM, 0]), NAMES)[1]
    assert place([*SYSTEM, 1], over)[-1] == home                 # the most loaded is tried last


def test_different_prefixes_spread_over_the_replicas() -> None:
    homes = {place([p, *SYSTEM], views())[0] for p in range(60)}
    assert homes == set(NAMES)


def test_short_prompts_go_to_the_least_loaded_and_ties_rotate() -> None:
    assert place([1, 2, 3], views(r0=3, r1=1, r2=2)) == [NAMES[1], NAMES[2], NAMES[0]]
    assert [place([1, 2, 3], views(), tie_break=i)[0] for i in range(3)] == NAMES


def test_full_kv_and_unusable_replicas() -> None:
    home = rendezvous_rank(prefix_key([*SYSTEM, 0]), NAMES)[0]
    replicas = [ReplicaView(n, num_free_kv_blocks=5 if n == home else 90, num_kv_blocks=100) for n in NAMES]
    assert place([*SYSTEM, 0], replicas)[0] != home and place([*SYSTEM, 0], replicas)[-1] == home
    down = [ReplicaView(n, usable=n != home) for n in NAMES]
    assert home not in place([*SYSTEM, 0], down) and len(place([*SYSTEM, 0], down)) == 2
    assert place([1], [ReplicaView("a", usable=False)]) == []


class CountingStub:
    """A verifier stub that counts the sessions started through it."""

    def __init__(self, stub: object) -> None:
        self.stub, self.started = stub, 0

    def StartSession(self, *args: object, **kwargs: object):  # noqa: N802, ANN201 (gRPC method name)
        self.started += 1
        return self.stub.StartSession(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self.stub, name)


async def complete(port: int, prompt: str) -> None:
    async for _ in client.stream(f"127.0.0.1:{port}", client.make_request(prompt, max_new_tokens=2), timeout_s=60):
        pass


async def test_requests_sharing_a_system_prompt_meet_on_one_replica() -> None:
    replicas = [await start_verifier(), await start_verifier()]
    config = GatewayConfig(port=0, verifier_addr=",".join(r.addr for r in replicas), draft_addr="",
                           enable_cache=False, enable_ngram=False, suffix_drafting=False, adaptive_draft_length=False)
    gateway = await build_gateway_parts(config, wait_for_verifier_s=30)
    port = await gateway.server.start("127.0.0.1", 0)
    stubs = {addr: CountingStub(r.stub) for addr, r in gateway.verifiers.replicas.items()}
    for addr, stub in stubs.items():
        gateway.verifiers.replicas[addr].stub = stub          # type: ignore[assignment]
    system = "You are a careful assistant. Answer in one short sentence, and never invent facts. "
    try:
        for question in ("Why is the sky blue?", "What is a prime?", "Name a river.", "Who wrote Hamlet?",
                         "What is rain?", "Define entropy."):
            await complete(port, system + question)
        other, home = sorted(stubs.values(), key=lambda s: s.started)
        assert (other.started, home.started) == (0, 6)       # round-robin: 3 and 3
        for question in ("a", "b", "c", "d"):                 # no full block in common: by load, ties in turn
            await complete(port, question)
        assert other.started >= 1 and other.started + home.started == 10
    finally:
        await gateway.server.stop(0)
        for r in replicas:
            await r.stop()


def test_other_policies_for_comparison() -> None:
    from gateway.placement import check_policy
    busy = views(r0=5)
    assert place([*SYSTEM, 1], busy, policy="least_loaded")[0] != NAMES[0]
    assert [place([*SYSTEM, 1], busy, tie_break=i, policy="round_robin")[0] for i in range(3)] == NAMES
    with pytest.raises(ValueError, match="placement must be one of prefix, least_loaded, round_robin; got 'x'"):
        check_policy("x")
