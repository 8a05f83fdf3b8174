"""The C kernels' thread pools (cpu_pool.h, cpu_build.share_pools): by default every kernel library of a process runs
its jobs on one pool, so a forward that alternates between int4 matmuls and attention keeps one worker a core
beyond the caller's, not one per library; the numbers are the same either way."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specmesh.engine import attention_kernel

# Run in a fresh interpreter: a pool's workers live as long as the process, so threads are counted from zero.
SCRIPT = """
import hashlib, os, sys, torch
torch.set_num_threads(1)
from specmesh.engine import attention_kernel, cpu_build
from specmesh.engine.int4_linear import Int4GroupLinear
from specmesh.engine.kernel_threads import kernel_threads
if sys.argv[1] == "separate":
    cpu_build.share_pools(False)
torch.manual_seed(0)
layer = Int4GroupLinear(torch.nn.Linear(64, 512))
rows, slots = 32, 64
keys, values, query = torch.randn(slots, 2, 16), torch.randn(slots, 2, 16), torch.randn(rows, 4, 16)
flat = torch.arange(slots, dtype=torch.int32).repeat(rows)
lengths = torch.full((rows,), slots)
starts = torch.arange(rows) * slots
x = torch.randn(rows, 64)
attention_kernel.library()
before = len(os.listdir("/proc/self/task"))
digest = hashlib.sha256()
with kernel_threads(2):
    for _ in range(3):
        digest.update(layer(x).numpy().tobytes())
        digest.update(attention_kernel.paged_attention(query, keys, values, flat, starts, lengths, slots, 0.25)
                      .numpy().tobytes())
from specmesh.telemetry.cpu_wait import kernel_worker_ids
print(len(os.listdir("/proc/self/task")) - before, digest.hexdigest(), len(kernel_worker_ids()))
"""


def workers_and_digest(mode: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True)
    count, digest, named = out.stdout.split()
    assert int(named) == int(count), "every pool worker carries its name (cpu_wait.py finds them by it)"
    return int(count), digest


@pytest.mark.skipif(attention_kernel.library() is None, reason="the attention kernel cannot run here")
def test_int4_and_attention_jobs_share_one_worker_and_give_the_same_numbers() -> None:
    shared_workers, shared_digest = workers_and_digest("shared")
    separate_workers, separate_digest = workers_and_digest("separate")
    assert (shared_workers, separate_workers) == (1, 2)
    assert shared_digest == separate_digest
