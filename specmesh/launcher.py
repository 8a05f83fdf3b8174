"""Starts the three services as child processes (`specmesh up`) and waits until each reports SERVING."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PRESETS: dict[str, tuple[str, str]] = {
    "tiny": ("tiny-target", "tiny-draft"),
    "tiny-unrelated": ("tiny-target", "tiny-draft-unrelated"),
    "qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
}


@dataclass(frozen=True)
class StackConfig:
    target: str
    draft: str                     # "" = no draft service
    host: str = "127.0.0.1"
    gateway_port: int = 50051
    verifier_port: int = 50061
    draft_port: int = 50062
    num_threads: int = 1           # torch threads per model service
    verifier_threads: int = 0      # torch threads of the verifier (0 = num_threads)
    extra_env: Mapping[str, str] = field(default_factory=dict)
    draft_link_addr: str = ""      # where gateways dial the draft service ("" = draft_port; e.g. a WAN proxy)

    @property
    def draft_addr(self) -> str:
        if not self.draft:
            return ""
        return self.draft_link_addr or f"{self.host}:{self.draft_port}"

    @property
    def gateway_addr(self) -> str:
        return f"{self.host}:{self.gateway_port}"


def wait_serving(addr: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Polls grpc.health.v1 until SERVING; fails early if the process died."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"service for {addr} exited with code {proc.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{addr} not SERVING after {timeout_s:.0f} s")
            time.sleep(0.3)


class Stack:
    """The running services; `stop()` sends SIGTERM (graceful drain) and waits."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._spawn_args: dict[str, tuple[str, dict[str, str], str]] = {}

    def _spawn(self, name: str, module: str, env: dict[str, str], addr: str = "") -> subprocess.Popen[bytes]:
        full_env = {**os.environ, **self.config.extra_env, **env}
        proc = subprocess.Popen([sys.executable, "-m", module], env=full_env)
        self.procs[name] = proc
        self._spawn_args[name] = (module, env, addr)
        return proc

    def restart(self, name: str, timeout_s: float = 300.0, hard: bool = True) -> None:
        """Kill (SIGKILL if hard, else SIGTERM) and start one service again; waits until it is SERVING."""
        proc = self.procs[name]
        if hard:
            proc.kill()
        else:
            proc.send_signal(signal.SIGTERM)
        proc.wait()
        module, env, addr = self._spawn_args[name]
        wait_serving(addr, timeout_s, self._spawn(name, module, env, addr))

    def start(self, timeout_s: float = 900.0) -> None:
        c = self.config
        verifier = self._spawn("verifier", "verifier_service", {
            "SPECMESH_VERIFIER_MODEL": c.target, "SPECMESH_VERIFIER_HOST": c.host,
            "SPECMESH_VERIFIER_PORT": str(c.verifier_port),
            "SPECMESH_VERIFIER_NUM_THREADS": str(c.verifier_threads or c.num_threads)},
            f"{c.host}:{c.verifier_port}")
        draft = None
        if c.draft:
            draft = self._spawn("draft", "draft_service", self._draft_env(c.draft_port), f"{c.host}:{c.draft_port}")
        try:
            wait_serving(f"{c.host}:{c.verifier_port}", timeout_s, verifier)
            if draft is not None:
                wait_serving(f"{c.host}:{c.draft_port}", timeout_s, draft)
            self.add_gateway("gateway", c.gateway_port, {}, timeout_s)
        except BaseException:
            self.stop()
            raise

    def add_gateway(self, name: str, port: int, env: Mapping[str, str], timeout_s: float = 900.0,
                    draft_addr: str | None = None) -> str:
        """Starts one more gateway on `port` against the same verifier and (unless `draft_addr`) the same draft
        service, with `env` on top of the stack's environment (e.g. other drafting tiers); waits until SERVING and
        returns its address."""
        c = self.config
        addr = f"{c.host}:{port}"
        proc = self._spawn(name, "gateway", {
            **env, "SPECMESH_GATEWAY_HOST": c.host, "SPECMESH_GATEWAY_PORT": str(port),
            "SPECMESH_GATEWAY_VERIFIER_ADDR": f"{c.host}:{c.verifier_port}",
            "SPECMESH_GATEWAY_DRAFT_ADDR": c.draft_addr if draft_addr is None else draft_addr}, addr)
        wait_serving(addr, timeout_s, proc)
        return addr

    def add_draft(self, name: str, port: int, env: Mapping[str, str], timeout_s: float = 900.0) -> str:
        """Starts one more draft service (the stack's draft model) on `port` with `env` on top of the stack's
        environment (e.g. another draft LM head); waits until SERVING and returns its address."""
        addr = f"{self.config.host}:{port}"
        wait_serving(addr, timeout_s, self._spawn(name, "draft_service", {**env, **self._draft_env(port)}, addr))
        return addr

    def _draft_env(self, port: int) -> dict[str, str]:
        c = self.config
        return {"SPECMESH_DRAFT_MODEL": c.draft, "SPECMESH_DRAFT_HOST": c.host, "SPECMESH_DRAFT_PORT": str(port),
                "SPECMESH_DRAFT_NUM_THREADS": str(c.num_threads)}

    def stop(self, timeout_s: float = 20.0) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
