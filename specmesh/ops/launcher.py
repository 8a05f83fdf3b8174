"""Starts the three services as child processes (`specmesh up`) and waits until each of them is serving.

Before anything starts, every port the stack will open is checked to be free. A child counts as up only when it is
alive, printed its own "ready: ... on host:port" line for the expected port, and answers health checks SERVING; a
stranger already holding the port can never pass for it.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.ops.cores import draft_host_share_env, draft_threads_env, num_cores, shares_cores, verifier_threads_env

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
    verifier_threads: int = 0      # torch threads of the verifier (0 = num_threads); its steps may use more cores
                                   # (specmesh/ops/cores.py)
    extra_env: Mapping[str, str] = field(default_factory=dict)
    draft_link_addr: str = ""      # where gateways dial the draft service ("" = draft_port; e.g. a WAN proxy)
    http_port: int = 0             # gateway's OpenAI-compatible HTTP API; 0 = off (`specmesh up` passes 8000)
    metrics_port: int = 0          # /metrics: gateway on this port, verifier +1, draft +2; 0 = off
    trace_file: str = ""           # JSON-lines span file shared by the three services; "" = off
    taskset: Mapping[str, str] = field(default_factory=dict)  # child name -> `taskset -c` cpu list (e.g. pinning)
    nice: Mapping[str, int] = field(default_factory=dict)     # child name -> `nice -n` increment (e.g. benchmarks)
    verifier_dtype: str = ""       # SPECMESH_VERIFIER_DTYPE for the verifier; "" = its own configuration (auto)
    draft_dtype: str = ""          # SPECMESH_DRAFT_DTYPE for the draft service; "" = its own configuration

    @property
    def draft_addr(self) -> str:
        if not self.draft:
            return ""
        return self.draft_link_addr or f"{dial_host(self.host)}:{self.draft_port}"

    @property
    def gateway_addr(self) -> str:
        return f"{self.host}:{self.gateway_port}"

    def metrics_port_of(self, service: str) -> int:
        """The /metrics port of "gateway", "verifier" or "draft" (0 = off)."""
        return self.metrics_port + METRICS_PORT_OFFSETS[service] if self.metrics_port else 0

    def ports(self) -> list[tuple[str, int]]:
        """(what, port) of every port the stack opens, in start order."""
        out = [("verifier", self.verifier_port)]
        if self.draft:
            out.append(("draft", self.draft_port))
        out.append(("gateway", self.gateway_port))
        if self.http_port:
            out.append(("gateway HTTP", self.http_port))
        services = ["gateway", "verifier"] + (["draft"] if self.draft else [])
        out += [(f"{name} metrics", self.metrics_port_of(name)) for name in services if self.metrics_port]
        return out

    def endpoints(self) -> list[tuple[str, str]]:
        """(what, where) of everything the stack serves, for the user."""
        out = [("gateway gRPC", self.gateway_addr), ("verifier gRPC", f"{self.host}:{self.verifier_port}")]
        if self.draft:
            out.append(("draft gRPC", f"{self.host}:{self.draft_port}"))
        if self.http_port:
            out.append(("OpenAI-compatible HTTP", f"http://{self.host}:{self.http_port}/v1"))
        out += [(what, f"http://{self.host}:{port}/metrics") for what, port in self.ports()
                if what.endswith(" metrics")]
        if self.trace_file:
            out.append(("trace file", os.path.abspath(self.trace_file)))
        return out


METRICS_PORT_OFFSETS: dict[str, int] = {"gateway": 0, "verifier": 1, "draft": 2}
READY_LINE = re.compile(r"^ready: .* on (?P<host>\S+):(?P<port>\d+)$")


class StartError(RuntimeError):
    """The stack could not start: a port is taken, a child died or never became ready."""


class PortInUseError(StartError):
    def __init__(self, what: str, host: str, port: int) -> None:
        super().__init__(f"port {port} ({what}) is already in use on {host}")
        self.what, self.host, self.port = what, host, port


def port_is_free(host: str, port: int) -> bool:
    """Whether a listening socket could bind host:port now (SO_REUSEADDR, as gRPC binds)."""
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return False
                raise
    return True


def check_ports_free(host: str, ports: list[tuple[str, int]]) -> None:
    """Raises PortInUseError for the first taken port, StartError when two services were given one port."""
    seen: dict[int, str] = {}
    for what, port in ports:
        if port in seen:
            raise StartError(f"port {port} is given to both {seen[port]} and {what}")
        seen[port] = what
        if not port_is_free(host, port):
            raise PortInUseError(what, host, port)


class ChildOutput:
    """Reads a child's stdout on a daemon thread: remembers its "ready: ... on host:port" line and passes every
    other line through to our stdout."""

    def __init__(self, proc: subprocess.Popen[bytes], echo: bool = True) -> None:
        self.ready = threading.Event()
        self.ready_port = 0
        self._echo = echo
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            match = READY_LINE.match(line)
            if match and not self.ready.is_set():
                self.ready_port = int(match["port"])
                self.ready.set()
            elif self._echo:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()


def wait_child_ready(name: str, proc: subprocess.Popen[bytes], output: ChildOutput, port: int,
                     timeout_s: float) -> None:
    """Until our child printed its ready line for `port` and reports SERVING there; fails early if it died."""
    deadline = time.monotonic() + timeout_s
    while not output.ready.wait(0.2):
        if proc.poll() is not None:
            raise StartError(f"{name} (pid {proc.pid}) exited with code {proc.returncode} before it was ready "
                             f"(its error is printed above)")
        if time.monotonic() > deadline:
            raise StartError(f"{name} (pid {proc.pid}) not ready after {timeout_s:.0f} s")
    if output.ready_port != port:
        raise StartError(f"{name} (pid {proc.pid}) is serving on port {output.ready_port}, expected {port}")


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


def dial_host(host: str) -> str:
    """Where to reach a service listening on `host` from this machine."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


class Stack:
    """The running services; `stop()` sends SIGTERM (graceful drain) and waits."""

    def __init__(self, config: StackConfig, echo_output: bool = True) -> None:
        self.config = config
        self.echo_output = echo_output          # pass the children's stdout (all but ready lines) through
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.outputs: dict[str, ChildOutput] = {}
        self._spawn_args: dict[str, tuple[str, dict[str, str], int]] = {}

    def _spawn(self, name: str, module: str, env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
        full_env = {**os.environ, **self.config.extra_env, **env}
        cpus = self.config.taskset.get(name, "")
        pin = ["taskset", "-c", cpus] if cpus else []
        niceness = self.config.nice.get(name, 0)
        lower = ["nice", "-n", str(niceness)] if niceness else []
        proc = subprocess.Popen([*pin, *lower, sys.executable, "-m", module], env=full_env, stdout=subprocess.PIPE)
        self.procs[name] = proc
        self.outputs[name] = ChildOutput(proc, self.echo_output)
        self._spawn_args[name] = (module, env, port)
        return proc

    def _wait_ready(self, name: str, timeout_s: float) -> str:
        """Our child `name` printed its ready line for its port and is SERVING there; returns its address."""
        deadline = time.monotonic() + timeout_s
        proc, port = self.procs[name], self._spawn_args[name][2]
        wait_child_ready(name, proc, self.outputs[name], port, timeout_s)
        addr = f"{dial_host(self.config.host)}:{port}"
        wait_serving(addr, max(1.0, deadline - time.monotonic()), proc)
        return addr

    def restart(self, name: str, timeout_s: float = 300.0, hard: bool = True) -> None:
        """Kill (SIGKILL if hard, else SIGTERM) and start one service again; waits until it is SERVING."""
        proc = self.procs[name]
        if hard:
            proc.kill()
        else:
            proc.send_signal(signal.SIGTERM)
        proc.wait()
        module, env, port = self._spawn_args[name]
        self._spawn(name, module, env, port)
        self._wait_ready(name, timeout_s)

    def start(self, timeout_s: float = 900.0) -> None:
        """Checks every port is free, starts verifier and draft service, then the gateway once both are ready."""
        c = self.config
        check_ports_free(c.host, c.ports())
        self._spawn("verifier", "verifier_service", self.verifier_env(), c.verifier_port)
        if c.draft:
            self._spawn("draft", "draft_service", {**self._draft_env(c.draft_port), **self._telemetry_env("draft")},
                        c.draft_port)
        try:
            self._wait_ready("verifier", timeout_s)
            if c.draft:
                self._wait_ready("draft", timeout_s)
            self.add_gateway("gateway", c.gateway_port, self._telemetry_env("gateway", http=True), timeout_s)
        except BaseException:
            self.stop()
            raise

    def verifier_env(self) -> dict[str, str]:
        """The verifier's environment (on top of the stack's): its model, address, threads and numerics."""
        c = self.config
        return {
            "SPECMESH_VERIFIER_MODEL": c.target, "SPECMESH_VERIFIER_HOST": c.host,
            "SPECMESH_VERIFIER_PORT": str(c.verifier_port),
            **verifier_threads_env(c.verifier_threads or c.num_threads, num_cores(c.taskset.get("verifier", "")),
                                   bool(c.draft) and shares_cores(c.taskset.get("verifier", ""),
                                                                  c.taskset.get("draft", "")),
                                   {**os.environ, **c.extra_env}),
            **({"SPECMESH_VERIFIER_DTYPE": c.verifier_dtype} if c.verifier_dtype else {}),
            **self._telemetry_env("verifier")}

    def _telemetry_env(self, service: str, http: bool = False) -> dict[str, str]:
        c, prefix = self.config, f"SPECMESH_{service.upper()}_"
        env = {prefix + "METRICS_PORT": str(c.metrics_port_of(service))} if c.metrics_port else {}
        if c.trace_file:
            env[prefix + "TRACE_FILE"] = os.path.abspath(c.trace_file)
        if http and (c.http_port or prefix + "HTTP_PORT" not in c.extra_env):   # 0 said too: the gateway's own
            env[prefix + "HTTP_PORT"] = str(c.http_port)                       # default (8000) is on
        return env

    def add_gateway(self, name: str, port: int, env: Mapping[str, str], timeout_s: float = 900.0,
                    draft_addr: str | None = None) -> str:
        """Starts one more gateway on `port` against the same verifier and (unless `draft_addr`) the same draft
        service, with `env` on top of the stack's environment (e.g. other drafting tiers); waits until SERVING and
        returns its address."""
        c = self.config
        backend = dial_host(c.host)
        self._spawn(name, "gateway", {
            **self._draft_share_env(),
            "SPECMESH_GATEWAY_HTTP_PORT": "0",     # extra gateways: no HTTP API unless `env` asks for one
            **env, "SPECMESH_GATEWAY_HOST": c.host, "SPECMESH_GATEWAY_PORT": str(port),
            "SPECMESH_GATEWAY_VERIFIER_ADDR": f"{backend}:{c.verifier_port}",
            "SPECMESH_GATEWAY_DRAFT_ADDR": c.draft_addr if draft_addr is None else draft_addr}, port)
        return self._wait_ready(name, timeout_s)

    def add_draft(self, name: str, port: int, env: Mapping[str, str], timeout_s: float = 900.0) -> str:
        """Starts one more draft service (the stack's draft model) on `port` with `env` on top of the stack's
        environment (e.g. another draft LM head); waits until SERVING and returns its address."""
        self._spawn(name, "draft_service", {**env, **self._draft_env(port)}, port)
        return self._wait_ready(name, timeout_s)

    def _draft_share_env(self) -> dict[str, str]:
        """What a running draft takes from the verifier's cores, as the gateway prices it (specmesh/ops/cores.py)."""
        c = self.config
        if not c.draft:
            return {}
        user_env = {**os.environ, **c.extra_env}
        threads = {**self._draft_threads_env(), **user_env}["SPECMESH_DRAFT_NUM_THREADS"]
        return draft_host_share_env(int(threads), c.taskset.get("verifier", ""), c.taskset.get("draft", ""), user_env)

    def _draft_threads_env(self) -> dict[str, str]:
        """The draft service's threads and drafting ahead (specmesh/ops/cores.py), the user's variables apart."""
        c = self.config
        return draft_threads_env(c.num_threads, c.taskset.get("verifier", ""), c.taskset.get("draft", ""),
                                 {**os.environ, **c.extra_env})

    def _draft_env(self, port: int) -> dict[str, str]:
        c = self.config
        return {"SPECMESH_DRAFT_MODEL": c.draft, "SPECMESH_DRAFT_HOST": c.host, "SPECMESH_DRAFT_PORT": str(port),
                **self._draft_threads_env(),
                **({"SPECMESH_DRAFT_DTYPE": c.draft_dtype} if c.draft_dtype else {})}

    def exited(self) -> dict[str, int]:
        """name -> exit code of every child that is no longer running."""
        return {name: proc.returncode for name, proc in self.procs.items() if proc.poll() is not None}

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
