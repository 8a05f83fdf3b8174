"""Where the gateway's replicas are: fixed addresses and DNS names it keeps re-resolving.

`verifier_addr` / `draft_addr` are comma-separated entries, each `host:port` (one replica, resolved by gRPC as
usual) or `dns:///NAME:PORT`: every A/AAAA record of NAME is a replica of its own (one channel per address, so a
session stays pinned to the process that holds its KV). That is a Kubernetes headless Service (its records are the
ready pods) or a Compose service scaled with `--scale verifier=2` (Compose's DNS answers every container). The
names are resolved again every `discovery_interval_s`: a new pod gets sessions within that, a removed one gets
none (its sessions move, gateway/verifier_session.py). A failed lookup keeps the name's last answer (a DNS blip
must not empty the pool). The resolver is injectable, so tests can add and remove replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"
Resolver = Callable[[str, int], Awaitable[list[str]]]     # (host, port) -> "ip:port" addresses


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address of host (sorted: the same order on every gateway)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    # str(): getaddrinfo's sockaddr types allow bytes (AF_PACKET); stream sockets of AF_INET/AF_INET6 give str, int
    addrs = {f"[{a[4][0]}]:{str(a[4][1])}" if a[0] == socket.AF_INET6 else f"{a[4][0]}:{str(a[4][1])}" for a in infos}
    return sorted(addrs)


@dataclass(frozen=True)
class Entry:
    target: str                    # host:port as written, or NAME:PORT of a dns:/// entry
    dynamic: bool                  # dns:///: resolved here, again and again

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.target.rpartition(":")
        return host.strip("[]"), int(port)


def parse_addrs(spec: str, field_name: str) -> list[Entry]:
    """Entries of a comma-separated address list; ValueError naming the field for a malformed one."""
    entries = []
    for raw in (a.strip() for a in spec.split(",")):
        if not raw:
            continue
        dynamic = raw.startswith(DNS_PREFIX)
        target = raw[len(DNS_PREFIX):] if dynamic else raw
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{field_name}: {raw!r} is not host:port or dns:///NAME:PORT")
        entries.append(Entry(target, dynamic))
    return entries


@dataclass
class Discovery:
    """The current addresses of one address list; `on_change(addrs)` is called with every new set."""
    entries: Sequence[Entry]
    on_change: Callable[[list[str]], object]
    resolver: Resolver = resolve_dns
    interval_s: float = 5.0
    _last: dict[str, list[str]] = field(default_factory=dict)    # dns target -> its last answer
    server_names: dict[str, str] = field(default_factory=dict)   # resolved address -> the DNS name (TLS checks it)
    _addrs: list[str] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    @property
    def addrs(self) -> list[str]:
        return list(self._addrs)

    async def refresh(self) -> list[str]:
        """Resolves every dns:/// entry once; reports the set when it changed. Returns it."""
        addrs: list[str] = []
        for entry in self.entries:
            if not entry.dynamic:
                addrs.append(entry.target)
                continue
            try:
                self._last[entry.target] = await self.resolver(*entry.host_port)
                self.server_names.update(dict.fromkeys(self._last[entry.target], entry.host_port[0]))
            except OSError as exc:
                log.warning("resolving %s failed (%s); keeping its last %d addresses", entry.target, exc,
                            len(self._last.get(entry.target, [])))
            addrs.extend(self._last.get(entry.target, []))
        addrs = list(dict.fromkeys(addrs))
        if addrs != self._addrs:
            log.info("replicas of %s: %s", ",".join(e.target for e in self.entries), ", ".join(addrs) or "none")
            self._addrs = addrs
            self.on_change(addrs)
        return addrs

    @property
    def dynamic(self) -> bool:
        return any(e.dynamic for e in self.entries)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:                  # never let discovery die silently
                log.exception("replica discovery failed")

    def start(self) -> None:
        if self.dynamic and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="replica-discovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
