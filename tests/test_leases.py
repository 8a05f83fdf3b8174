"""The lease table (specmesh/rpc/leases.py) on a fake clock: ownership, idle expiry, in-flight calls, close."""

from __future__ import annotations

import random

import pytest

from specmesh.engine.loop import EngineError
from specmesh.rpc.leases import (
    MAX_SESSION_ID_BYTES,
    SessionLeases,
    check_owner_token,
    check_session_id,
    new_session_id,
    reap_expired,
    reap_interval_s,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(lease_s: float = 30.0) -> tuple[SessionLeases, FakeClock]:
    clock = FakeClock()
    return SessionLeases(lease_s, clock), clock


def test_open_returns_distinct_unguessable_tokens() -> None:
    leases, _ = table()
    tokens = {leases.open(f"s{i}") for i in range(50)}
    assert len(tokens) == 50 and all(len(t) >= 20 for t in tokens)
    with pytest.raises(EngineError) as info:
        leases.open("s0")
    assert info.value.code == "ALREADY_EXISTS"


@pytest.mark.parametrize("token", ["", "wrong", "x" * 22])
def test_wrong_or_missing_token_is_permission_denied(token: str) -> None:
    leases, _ = table()
    leases.open("s")
    with pytest.raises(EngineError) as info:
        leases.check("s", token)
    assert info.value.code == "PERMISSION_DENIED"
    with pytest.raises(EngineError) as info, leases.call("s", token):
        pass
    assert info.value.code == "PERMISSION_DENIED"


def test_unknown_session_looks_like_a_wrong_token() -> None:
    leases, _ = table()
    token = leases.open("s")
    with pytest.raises(EngineError) as wrong:
        leases.check("s", "wrong")
    with pytest.raises(EngineError) as unknown:
        leases.check("other", token)
    assert wrong.value.code == unknown.value.code == "PERMISSION_DENIED"
    assert str(unknown.value).replace("other", "s") == str(wrong.value)


def test_idle_session_expires_after_the_lease() -> None:
    leases, clock = table(30.0)
    leases.open("a")
    clock.now += 10
    leases.open("b")
    clock.now += 19.9
    assert leases.expired() == []
    clock.now += 0.1
    assert leases.expired() == ["a"]
    clock.now += 10
    assert sorted(leases.expired()) == ["a", "b"]


def test_a_call_renews_the_lease_when_it_ends() -> None:
    leases, clock = table(30.0)
    token = leases.open("a")
    clock.now += 29
    with leases.call("a", token):
        clock.now += 5
    assert leases.expired(clock.now + 29.9) == []
    assert leases.expired(clock.now + 30) == ["a"]


def test_call_in_flight_holds_the_lease() -> None:
    leases, clock = table(1.0)
    token = leases.open("a")
    with leases.call("a", token):
        clock.now += 1000                     # a long prefill or queue wait: never expires mid-call
        assert leases.expired() == []
        with leases.call("a", token):        # two calls at once (a prefetch next to a propose)
            pass
        assert leases.expired() == []         # the outer call still runs
    assert leases.expired() == []             # idle time starts when the last call ends
    clock.now += 1
    assert leases.expired() == ["a"]
    leases.check_invariants()


def test_call_that_raises_still_releases_the_lease() -> None:
    leases, clock = table(1.0)
    token = leases.open("a")
    with pytest.raises(RuntimeError), leases.call("a", token):
        raise RuntimeError("engine failed")
    clock.now += 1
    assert leases.expired() == ["a"]


def test_close_forgets_the_session_and_its_token() -> None:
    leases, clock = table(1.0)
    token = leases.open("a")
    assert leases.close("a") and not leases.close("a")
    assert "a" not in leases and len(leases) == 0
    clock.now += 5
    assert leases.expired() == []
    with pytest.raises(EngineError):
        leases.check("a", token)
    assert leases.open("a") != token          # reopened: the old token opens nothing


def test_call_ending_after_close_and_reopen_does_not_touch_the_new_lease() -> None:
    leases, clock = table(1.0)
    old = leases.open("a")
    with leases.call("a", old):
        leases.close("a")
        new = leases.open("a")
        with leases.call("a", new):
            pass
    clock.now += 1
    assert leases.expired() == ["a"]          # the new lease counts no call of the old owner
    leases.check_invariants()


def test_bind_opens_with_the_callers_token_then_checks_it() -> None:
    leases, _ = table()
    assert leases.bind("d", "mine") is True
    assert leases.bind("d", "mine") is False
    with pytest.raises(EngineError) as info:
        leases.bind("d", "theirs")
    assert info.value.code == "PERMISSION_DENIED"


def test_reap_expired_ends_each_expired_session_once() -> None:
    leases, clock = table(2.0)
    keep = leases.open("keep")
    leases.open("idle")
    ended: list[str] = []
    counted: list[int] = []
    clock.now += 1.5
    with leases.call("keep", keep):
        clock.now += 1
        assert reap_expired(leases, ended.append, lambda: counted.append(1)) == ["idle"]
    assert reap_expired(leases, ended.append, lambda: counted.append(1)) == []
    assert ended == ["idle"] and len(counted) == 1 and "idle" not in leases and "keep" in leases
    assert reap_interval_s(30.0) == 1.0 and reap_interval_s(1.0) == 0.25


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(7)
    leases, clock = table(3.0)
    tokens: dict[str, str] = {}
    for _ in range(2000):
        sid = f"s{rng.randrange(8)}"
        op = rng.randrange(4)
        if op == 0 and sid not in leases:
            tokens[sid] = leases.open(sid)
        elif op == 1 and sid in leases:
            with leases.call(sid, tokens[sid]):
                clock.now += rng.random()
        elif op == 2:
            leases.close(sid)
        else:
            clock.now += rng.random() * 2
            for gone in leases.expired():
                leases.close(gone)
            assert leases.expired() == []
        leases.check_invariants()


def test_session_ids_and_tokens_are_bounded() -> None:
    assert check_session_id("a" * MAX_SESSION_ID_BYTES)
    for bad in ("", "a" * (MAX_SESSION_ID_BYTES + 1), "é" * 129):
        with pytest.raises(EngineError) as info:
            check_session_id(bad)
        assert info.value.code == "INVALID_ARGUMENT" and "session_id" in str(info.value)
    for bad in ("", "t" * 257):
        with pytest.raises(EngineError) as info:
            check_owner_token(bad)
        assert info.value.code == "INVALID_ARGUMENT" and "owner_token" in str(info.value)


def test_new_session_ids_fit_the_bound_and_are_unique() -> None:
    assert new_session_id("req-1").startswith("req-1-")
    ids = {new_session_id("😀" * 128) for _ in range(100)}       # 512 bytes of request id
    assert len(ids) == 100
    for sid in ids:
        assert check_session_id(sid) and sid.startswith("😀")
