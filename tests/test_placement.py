"""Placement of new sessions on verifier replicas: prefix affinity by rendezvous hashing, load fallback."""

from __future__ import annotations

from gateway.placement import OVERLOAD_SLACK, ReplicaView, place, prefix_key, rendezvous_rank

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
