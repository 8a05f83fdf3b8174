"""A private redis-server for the tests: a free port, no persistence, killed and restarted on demand."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

CLUSTER_BUS_OFFSET = 10000      # a cluster node also listens on port + 10000 (its cluster bus)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster-bus port (+10000) is a valid port and free too."""
    for _ in range(100):
        port = free_port()
        if port + CLUSTER_BUS_OFFSET <= 65535 and _is_free(port + CLUSTER_BUS_OFFSET):
            return port
        if port - CLUSTER_BUS_OFFSET > 1024 and _is_free(port - CLUSTER_BUS_OFFSET):
            return port - CLUSTER_BUS_OFFSET
    raise RuntimeError("no free port pair for a redis cluster node")


class RedisServer:
    def __init__(self, port: int | None = None, cluster: bool = False) -> None:
        self.port = port or (free_cluster_port() if cluster else free_port())
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = ""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.dir = tempfile.mkdtemp(prefix="specmesh-redis-")
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--loglevel", "warning", "--dir", self.dir]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        if self.cluster:
            self.cli("cluster", "addslotsrange", "0", "16383")
            for _ in range(100):
                if "cluster_state:ok" in self.cli("cluster", "info"):
                    break
                time.sleep(0.05)
        return self

    def _wait_ready(self) -> None:
        for _ in range(200):
            try:
                if self.cli("ping").strip() == "PONG":
                    return
            except subprocess.CalledProcessError:
                pass
            time.sleep(0.025)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def cli(self, *args: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, check=True,
                              timeout=10).stdout.decode()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
