"""The verifier replicas a gateway knows, with what each last reported, and which one a new session goes to.

A `Replica` is one verifier process (one address, one channel: sessions stay pinned to it). The set changes while
the gateway runs: discovery (gateway/discovery.py) adds and removes addresses, the health watch (gateway/health.py)
marks replicas down and up, and replies mark a replica draining. A generation waits on `Replica.lost` beside its
Verify: a replica that stops answering probes moves its streams at once (gateway/verifier_session.py) instead of
leaving them to a timeout; a draining one moves them between rounds. A replica discovery no longer lists gets no
new sessions, but the ones it holds stay pinned to it (its channel closes when the last one ends).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from gateway.placement import DEFAULT_BLOCK_SIZE, ReplicaView, check_policy, place
from protos.specmesh.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class Replica:
    addr: str
    stub: verifier_pb2_grpc.VerifierStub
    channel: grpc.aio.Channel | None = None       # closed when discovery drops the replica (None: not ours)
    up: bool = True                               # answers health probes
    draining: bool = False                        # said so in a reply: shutting down, move its sessions
    removed: bool = False                         # no longer discovered
    num_waiting: int = 0
    num_sessions: int = 0                         # as reported
    num_free_kv_blocks: int = 0
    num_kv_blocks: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    num_opened: int = 0                           # sessions this gateway holds on it now
    lost: asyncio.Event = field(default_factory=asyncio.Event)   # set while it does not answer probes

    @property
    def usable(self) -> bool:
        return self.up and not self.draining and not self.removed

    def set_up(self, up: bool) -> None:
        self.up = up
        if up:
            self.lost.clear()
        else:
            self.lost.set()

    def set_draining(self, draining: bool) -> None:
        if draining and not self.draining:
            log.warning("verifier %s is draining: its sessions move to other replicas", self.addr)
        self.draining = draining

    def remove(self) -> None:
        self.removed = True
        self._close_if_idle()

    def release(self) -> None:
        """One of this gateway's sessions on it ended (or moved)."""
        self.num_opened -= 1
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self.removed and self.num_opened <= 0 and self.channel is not None:
            channel, self.channel = self.channel, None
            asyncio.ensure_future(channel.close())

    def report(self, reply: verifier_pb2.VerifyResponse | verifier_pb2.ModelInfo) -> None:
        """Load from a VerifyResponse or ModelInfo. A VerifyResponse counts its own session, so num_sessions 0
        there is an older verifier that does not report it: the last value stays."""
        self.num_waiting = reply.num_waiting
        if isinstance(reply, verifier_pb2.ModelInfo) or reply.num_sessions:
            self.num_sessions = reply.num_sessions
            self.num_free_kv_blocks = reply.num_free_kv_blocks
        if isinstance(reply, verifier_pb2.ModelInfo):
            self.num_kv_blocks = reply.num_kv_blocks or self.num_kv_blocks
            self.block_size = reply.block_size or self.block_size
        self.set_draining(reply.draining)

    def view(self) -> ReplicaView:
        # The reported count lags behind sessions just opened here: count at least those.
        return ReplicaView(self.addr, self.usable, self.num_waiting, max(self.num_sessions, self.num_opened),
                           self.num_free_kv_blocks, self.num_kv_blocks)


class VerifierPool:
    """Replicas by address; `order()` is placement's answer for a new session."""

    def __init__(self, make_stub: Callable[[str], tuple[verifier_pb2_grpc.VerifierStub, grpc.aio.Channel | None]],
                 addrs: Sequence[str] = (), policy: str = "prefix") -> None:
        self.make_stub = make_stub
        self.policy = check_policy(policy)
        self.replicas: dict[str, Replica] = {}
        self.retired: list[Replica] = []              # removed, still holding this gateway's sessions
        self._requests = itertools.count()
        self.set_addrs(addrs)

    @classmethod
    def of_stubs(cls, stubs: Sequence[verifier_pb2_grpc.VerifierStub], names: Sequence[str] = ()) -> VerifierPool:
        """A fixed pool over given stubs (tests)."""
        pool = cls(lambda addr: (stubs[int(addr.rsplit("#", 1)[1])], None))
        pool.set_addrs([f"{names[i] if i < len(names) else 'replica'}#{i}" for i in range(len(stubs))])
        return pool

    def set_addrs(self, addrs: Sequence[str]) -> list[Replica]:
        """The discovered addresses now: new ones get a replica, missing ones are removed (their channels closed
        once idle; a session on them moves). Returns the removed replicas."""
        wanted = list(dict.fromkeys(addrs))
        for addr in wanted:
            if addr not in self.replicas:
                stub, channel = self.make_stub(addr)
                self.replicas[addr] = Replica(addr, stub, channel)
                log.info("verifier replica %s added", addr)
        removed = [r for a, r in self.replicas.items() if a not in wanted]
        for replica in removed:
            log.info("verifier replica %s removed", replica.addr)
            replica.remove()
            del self.replicas[replica.addr]
            self.retired.append(replica)
        return removed

    def probed(self) -> list[Replica]:
        """What the health watch probes: the replicas, and removed ones while sessions are pinned to them (one of
        those that freezes must still move its streams)."""
        self.retired = [r for r in self.retired if r.num_opened > 0 and r.channel is not None]
        return self.all() + self.retired

    def all(self) -> list[Replica]:
        return list(self.replicas.values())

    @property
    def serving(self) -> bool:
        return any(r.usable for r in self.replicas.values())

    def order(self, prompt_ids: Sequence[int], exclude: Sequence[Replica] = ()) -> list[Replica]:
        """Usable replicas in the order a new session should try them (gateway/placement.py)."""
        candidates = [r for r in self.replicas.values() if r not in exclude]
        block_size = candidates[0].block_size if candidates else DEFAULT_BLOCK_SIZE
        names = place(prompt_ids, [r.view() for r in candidates], block_size, next(self._requests), self.policy)
        return [self.replicas[n] for n in names]
