"""How long an engine's compute threads waited for a core during a forward: other tasks on its cores, made visible.

A forward runs on the engine thread and the C kernels' pool workers (specmesh/engine/cpu_pool.h names them
"specmesh-kernel"). When another task takes one of their cores, the forward runs on fewer cores for that long and
its step overruns the scheduler's time bound: a stream's gap beside a long prompt grows for a reason the scheduler
cannot see. Linux counts, per thread, the time it was runnable but not running (`/proc/self/task/<tid>/schedstat`,
second field, ns); the sum of that over the compute threads between two samples is the forward's CPU wait, put on
its span (`specmesh.step.cpu_wait_s`) and in `specmesh_engine_cpu_wait_seconds_total`.

Found on a 2-core Zen 5 (bench.stall, a 3,900-token prompt beside a stream): the steps that set the stream's longest
gap were ones whose threads had waited 45-85 ms for a core, while a short-lived Erlang VM (a host service's health
check, once a minute) ran; the median step waited 2 ms.

Where the file does not exist (not Linux, schedstat compiled out) `sample` returns None and nothing is reported.
"""

from __future__ import annotations

import os
import threading
import time

WORKER_NAME = "specmesh-kernel"      # cpu_pool.h's POOL_WORKER_NAME
RESCAN_S = 1.0                       # workers start on a kernel's first parallel call: look for new ones this often
TASKS = "/proc/self/task"


def _run_delay_ns(tid: int) -> int | None:
    """Nanoseconds thread `tid` of this process has spent runnable but waiting for a core (None: unknown)."""
    try:
        with open(f"{TASKS}/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def kernel_worker_ids() -> list[int]:
    """Thread ids of this process's kernel pool workers (by name)."""
    found: list[int] = []
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"{TASKS}/{tid}/comm", encoding="utf-8") as f:
                if f.read().strip() == WORKER_NAME:
                    found.append(int(tid))
        except (OSError, ValueError):
            continue
    return found


class CpuWait:
    """The summed run-queue wait of the calling (engine) thread and the kernel pool workers; sample before and
    after a forward, from the engine thread."""

    def __init__(self) -> None:
        self._workers: list[int] = []
        self._scanned_at = float("-inf")

    def _thread_ids(self) -> list[int]:
        now = time.monotonic()
        if now - self._scanned_at >= RESCAN_S:
            self._workers, self._scanned_at = kernel_worker_ids(), now
        return [threading.get_native_id(), *self._workers]

    def sample(self) -> dict[int, int] | None:
        """tid -> run-queue wait so far (ns) of the compute threads; None where the kernel does not count it."""
        delays = {tid: _run_delay_ns(tid) for tid in self._thread_ids()}
        known = {tid: ns for tid, ns in delays.items() if ns is not None}
        return known or None

    @staticmethod
    def seconds_since(before: dict[int, int] | None, after: dict[int, int] | None) -> float | None:
        """Seconds the threads in both samples waited between them (a worker that started in between counts from
        0: it waited no longer than it existed)."""
        if before is None or after is None:
            return None
        return sum(ns - before.get(tid, 0) for tid, ns in after.items() if ns >= before.get(tid, 0)) / 1e9
