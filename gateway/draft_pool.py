"""The draft service replicas a gateway knows (fixed or discovered, gateway/discovery.py): one per request.

A draft session holds only the draft model's KV, rebuilt from the context by a whole-context Propose, so the
choice is simple: the replica this gateway sent the fewest requests so far (ties rotate): a spread, not a load.
A request whose replica fails UNAVAILABLE goes target-only for a few rounds as always (gateway/draft_link.py) and
then continues on another replica (`reroute`), where the whole-context resend opens its session again.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence

import grpc

from protos.specmesh.v1 import draft_pb2_grpc


class DraftPool:
    def __init__(self, make_stub: Callable[[str], tuple[draft_pb2_grpc.DraftStub, grpc.aio.Channel | None]],
                 addrs: Sequence[str] = ()) -> None:
        self.make_stub = make_stub
        self.stubs: dict[str, draft_pb2_grpc.DraftStub] = {}
        self.channels: dict[str, grpc.aio.Channel | None] = {}
        self.num_picked: dict[str, int] = {}              # requests sent to each so far (a spread, not a load)
        self._turn = itertools.count()
        self.set_addrs(addrs)

    def set_addrs(self, addrs: Sequence[str]) -> None:
        wanted = list(dict.fromkeys(addrs))
        for addr in wanted:
            if addr not in self.stubs:
                self.stubs[addr], self.channels[addr] = self.make_stub(addr)
                self.num_picked[addr] = 0
        for addr in [a for a in self.stubs if a not in wanted]:
            del self.stubs[addr], self.num_picked[addr]
            channel = self.channels.pop(addr)
            if channel is not None:          # calls in flight end UNAVAILABLE: those requests reroute
                asyncio.ensure_future(channel.close(grace=30.0))

    def pick(self) -> draft_pb2_grpc.DraftStub | None:
        if not self.stubs:
            return None
        addrs = list(self.stubs)
        turn = next(self._turn)
        addr = min(addrs, key=lambda a: (self.num_picked[a], (addrs.index(a) - turn) % len(addrs)))
        self.num_picked[addr] += 1
        return self.stubs[addr]

    def reroute(self, failed: draft_pb2_grpc.DraftStub) -> draft_pb2_grpc.DraftStub:
        """Another replica than the failed one (the same when it is the only one)."""
        others = [s for s in self.stubs.values() if s is not failed]
        return others[next(self._turn) % len(others)] if others else failed
