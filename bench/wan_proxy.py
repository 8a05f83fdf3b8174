"""WAN emulation on loopback: a TCP proxy that adds one-way latency and a bandwidth limit to a link.

The machine has no netem, so benchmarks put this proxy on the draft link instead. Each direction of every
connection is modelled as a store-and-forward link:

    bytes read at time t -> leave the sender side once the direction's token bucket allows (serialization)
                         -> arrive at the other side `latency_ms` later (propagation)

so a request/response round trip costs at least 2 * latency_ms (RTT = 2x the one-way latency). The token
bucket (rate = bandwidth bytes/s, burst = one packet) is shared by all connections in the same direction, like
one physical link. Each direction has a single FIFO writer and delivery times never decrease, so byte order is
preserved; a half-close (EOF) is forwarded after the data before it. Works for any TCP protocol incl. gRPC/HTTP2.

Library:  async with WanProxy(0, "127.0.0.1:50062", latency_ms=20, bandwidth_bps=1.25e6) as p: use p.address
CLI:      python bench/wan_proxy.py --listen 127.0.0.1:56100 --target 127.0.0.1:50062 --rtt-ms 40 --bandwidth-mbps 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

READ_SIZE = 16 * 1024
MIN_PACKET = 1460            # one Ethernet MSS: the smallest unit the bandwidth limit serializes
PACKET_SECONDS = 0.002       # with a bandwidth limit, packets are at most ~2 ms of serialization time
MAX_QUEUED_CHUNKS = 4096     # per direction and connection: bounds memory (at most 64 MiB in flight)


def split_hostport(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


class TokenBucket:
    """Virtual-time token bucket: `reserve(n, now)` returns when n bytes have been serialized onto the link.

    Reservations never sleep; they advance the link's busy-until time, so callers can stamp a chunk with its
    departure time as soon as it is read. rate <= 0 means unlimited.
    """

    def __init__(self, rate_bytes_s: float, burst_bytes: int) -> None:
        self.rate = float(rate_bytes_s)
        self.burst = max(1, int(burst_bytes))
        self._tokens = float(self.burst)
        self._stamp: float | None = None

    def reserve(self, n: int, now: float) -> float:
        if self.rate <= 0:
            return now
        if self._stamp is None:
            self._stamp = now
        if now > self._stamp:   # refill for the idle time, capped at the burst
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
        self._tokens -= n
        if self._tokens >= 0:
            return self._stamp
        self._stamp += -self._tokens / self.rate   # link busy until the deficit is paid off
        self._tokens = 0.0
        return self._stamp


@dataclass
class LinkStats:
    connections: int = 0
    bytes_up: int = 0      # client -> target
    bytes_down: int = 0    # target -> client
    errors: list[str] = field(default_factory=list)


class WanProxy:
    """Loopback TCP proxy with one-way latency (ms, per direction) and bandwidth (bytes/s per direction).

    `latency_ms` and `bandwidth_bps` may be changed while running (new chunks use the new values; order is
    still preserved). `bandwidth_bps=0` means unlimited.
    """

    def __init__(self, listen_port: int, target_addr: str, latency_ms: float = 0.0, bandwidth_bps: float = 0.0,
                 listen_host: str = "127.0.0.1") -> None:
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.target_host, self.target_port = split_hostport(target_addr)
        self.latency_ms = float(latency_ms)
        self.stats = LinkStats()
        self._buckets: dict[str, TokenBucket] = {}
        self.bandwidth_bps = float(bandwidth_bps)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.port = 0

    @property
    def bandwidth_bps(self) -> float:
        return self._bandwidth

    @bandwidth_bps.setter
    def bandwidth_bps(self, value: float) -> None:
        self._bandwidth = float(value)
        burst = self.packet_size()
        self._buckets = {d: TokenBucket(self._bandwidth, burst) for d in ("up", "down")}

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    def packet_size(self) -> int:
        if self._bandwidth <= 0:
            return READ_SIZE
        return int(min(READ_SIZE, max(MIN_PACKET, self._bandwidth * PACKET_SECONDS)))

    async def start(self) -> WanProxy:
        self._server = await asyncio.start_server(self._on_client, self.listen_host, self.listen_port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> WanProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _on_client(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self.stats.connections += 1
        try:
            t_reader, t_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError as exc:
            self.stats.errors.append(f"connect {self.target_host}:{self.target_port}: {exc}")
            c_writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(self._pipe(c_reader, t_writer, "up"), self._pipe(t_reader, c_writer, "down"))
        except (ConnectionError, OSError) as exc:
            self.stats.errors.append(str(exc))
        finally:
            for w in (c_writer, t_writer):
                w.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        """Read chunks, stamp each with its delivery time, deliver them in order after that time."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_QUEUED_CHUNKS)
        deliver = asyncio.create_task(self._deliver(queue, writer, direction))
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await reader.read(self.packet_size())
                if not data:
                    break
                departs = self._buckets[direction].reserve(len(data), loop.time())
                await queue.put((departs + self.latency_ms / 1000.0, data))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put((loop.time() + self.latency_ms / 1000.0, b""))   # EOF travels the link too
        await deliver

    async def _deliver(self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter,
                       direction: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if not data:
                with contextlib.suppress(OSError, RuntimeError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            writer.write(data)
            if direction == "up":
                self.stats.bytes_up += len(data)
            else:
                self.stats.bytes_down += len(data)
            await writer.drain()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="127.0.0.1:56100", help="HOST:PORT to accept connections on")
    p.add_argument("--target", required=True, help="HOST:PORT to forward to")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time to add (half per direction)")
    p.add_argument("--bandwidth-mbps", type=float, default=0.0, help="megabits/s per direction (0 = unlimited)")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    host, port = split_hostport(args.listen)
    proxy = WanProxy(port, args.target, latency_ms=args.rtt_ms / 2, bandwidth_bps=args.bandwidth_mbps * 1e6 / 8,
                     listen_host=host)
    async with proxy:
        print(f"wan_proxy {proxy.address} -> {args.target} rtt={args.rtt_ms}ms "
              f"bandwidth={args.bandwidth_mbps or 'unlimited'}Mbit/s", flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
