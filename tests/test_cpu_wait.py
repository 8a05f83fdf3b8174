"""The CPU wait an engine forward reports (specmesh/telemetry/cpu_wait.py): the time its compute threads were
runnable but had no core, from Linux's per-thread schedstat."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specmesh.telemetry.cpu_wait import CpuWait

pytestmark = pytest.mark.skipif(not Path("/proc/self/schedstat").exists() or not hasattr(os, "sched_setaffinity"),
                                reason="no per-thread schedstat here")


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_thread_sharing_its_core_with_a_busy_process_reports_the_wait() -> None:
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    own = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(0, {cpu})         # this thread only (Linux affinity is per thread)
        time.sleep(0.1)                        # the hog is running on the core
        reading = CpuWait()
        before = reading.sample()
        spin(0.4)                              # wall time: about half of it on the core, half waiting
        waited = CpuWait.seconds_since(before, reading.sample())
    finally:
        os.sched_setaffinity(0, own)
        hog.kill()
        hog.wait()
    assert waited is not None and 0.08 <= waited <= 0.45


def test_no_reading_where_a_sample_is_missing() -> None:
    assert CpuWait.seconds_since(None, {1: 5}) is None
    assert CpuWait.seconds_since({1: 5}, None) is None
    assert CpuWait.seconds_since({1: 5, 2: 10}, {1: 7_000_000_005, 2: 10, 3: 1_000_000_000}) == pytest.approx(8.0)
