"""The services of a soak run as separate processes (verifier, draft service, gateway, redis-server on free ports),
the chaos loop that SIGKILLs and restarts them, and what is read from them: RSS, /metrics, GetModelInfo, Redis INFO.
Only public interfaces: gRPC health and GetModelInfo, Prometheus text, /proc, redis INFO."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import grpc

from bench.common import free_port_block, log
from bench.soak_report import Window
from protos.specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from specmesh.ops.launcher import PRESETS, Stack, StackConfig

SERVICES = ("verifier", "draft", "gateway")


class Redis:
    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()   # SIGKILL
            self.proc.wait()

    def used_memory(self) -> int | None:
        try:
            out = subprocess.run(["redis-cli", "-p", str(self.port), "info", "memory"], capture_output=True,
                                 text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        for line in out.splitlines():
            if line.startswith("used_memory:"):
                return int(line.split(":", 1)[1])
        return None


class SoakServices:
    """One verifier, one draft service, one gateway and (optionally) Redis, with /metrics on every service."""

    def __init__(self, preset: str, env: Mapping[str, str], threads: int, use_redis: bool) -> None:
        base = free_port_block(7)
        self.metrics_ports = {"verifier": base + 3, "draft": base + 4, "gateway": base + 5}
        self.redis = Redis(base + 6) if use_redis else None
        full_env = {f"SPECMESH_{svc.upper()}_METRICS_PORT": str(port) for svc, port in self.metrics_ports.items()}
        if self.redis is not None:
            full_env["SPECMESH_GATEWAY_REDIS_URL"] = f"redis://127.0.0.1:{self.redis.port}/0"
        full_env.update(env)
        target, draft = PRESETS[preset]
        self.stack = Stack(StackConfig(target=target, draft=draft, gateway_port=base, verifier_port=base + 1,
                                       draft_port=base + 2, num_threads=threads, extra_env=full_env))
        self.kills: Counter[str] = Counter()
        self.windows: list[Window] = []
        self.rss_samples: dict[str, list[tuple[float, int, float]]] = {}
        self.restarting: set[str] = set()     # not sampled while loading (its RSS would look like growth)

    @property
    def gateway_addr(self) -> str:
        return self.stack.config.gateway_addr

    @property
    def verifier_addr(self) -> str:
        return f"{self.stack.config.host}:{self.stack.config.verifier_port}"

    def start(self) -> None:
        if self.redis is not None:
            self.redis.start()
        log(f"starting verifier, draft service, gateway (gateway {self.gateway_addr})")
        self.stack.start()

    def stop(self) -> None:
        self.stack.stop()
        if self.redis is not None:
            self.redis.kill()

    def pids(self) -> dict[str, int]:
        pids = {name: p.pid for name, p in self.stack.procs.items() if p.poll() is None}
        if self.redis is not None and self.redis.proc is not None and self.redis.proc.poll() is None:
            pids["redis"] = self.redis.proc.pid
        return pids

    def kill_and_restart(self, name: str) -> Window:
        """SIGKILL one service and start it again (blocking; run in a thread). Redis stays down a moment."""
        killed = time.monotonic()
        self.restarting.add(name)
        if name == "redis":
            assert self.redis is not None
            self.redis.kill()
            time.sleep(random.uniform(0.5, 3.0))
            self.redis.start()
        else:
            self.stack.restart(name, hard=True)
        self.restarting.discard(name)
        self.kills[name] += 1
        window = Window(name, killed, time.monotonic())
        self.windows.append(window)
        return window

    def sample_rss(self) -> None:
        now = time.monotonic()
        for name, pid in self.pids().items():
            mb = None if name in self.restarting else rss_mb(pid)
            if mb is not None:
                self.rss_samples.setdefault(name, []).append((now, pid, mb))

    def metrics_text(self, service: str) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[service]}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return ""

    async def verifier_info(self) -> verifier_pb2.ModelInfo:
        async with grpc.aio.insecure_channel(self.verifier_addr) as channel:
            return await verifier_pb2_grpc.VerifierStub(channel).GetModelInfo(verifier_pb2.GetModelInfoRequest(),
                                                                              timeout=10)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


async def chaos(services: SoakServices, targets: list[str], every_s: float, stop: asyncio.Event) -> None:
    """Every ~`every_s` (0.5x..1.5x) SIGKILL one of `targets` (each in turn, in a shuffled order) and restart it."""
    rng = random.Random(7)
    order: list[str] = []
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_s * rng.uniform(0.5, 1.5))
            return
        except TimeoutError:
            pass
        if not order:
            order = rng.sample(targets, len(targets))
        name = order.pop()
        log(f"chaos: SIGKILL {name}")
        window = await asyncio.to_thread(services.kill_and_restart, name)
        log(f"chaos: {name} back after {window.up_s - window.killed_s:.1f} s")


async def sample_every(services: SoakServices, every_s: float, stop: asyncio.Event, t0: float,
                       held: list[list[float]]) -> None:
    """RSS of every service and [t, sessions, KV blocks used, queued] on the verifier, every `every_s`."""
    while not stop.is_set():
        services.sample_rss()
        try:
            info = await services.verifier_info()
            held.append([round(time.monotonic() - t0, 1), info.num_sessions,
                         info.num_kv_blocks - info.num_free_kv_blocks, info.num_waiting])
        except grpc.RpcError:
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_s)
