"""How many threads the C kernels' own pools (cpu_pool.h: int4 matmuls, paged attention) use, per calling thread.

With int4 linears the runner puts torch on one thread during a forward (so that torch's pool and the kernels' pools
do not spin against each other on the same cores) and hands the step's thread budget to the kernels through
`kernel_threads`; where torch's pool runs the linears (int8, float32) the runner gives the attention kernel one
thread the same way. Outside it they use torch's thread count.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class _KernelThreads(threading.local):
    num: int | None = None       # this thread's kernel thread count (kernel_threads); None = torch's


_threads = _KernelThreads()


@contextmanager
def kernel_threads(num_threads: int) -> Iterator[None]:
    """The C kernels called from this thread use `num_threads` threads of their own pools meanwhile."""
    previous = _threads.num
    _threads.num = num_threads
    try:
        yield
    finally:
        _threads.num = previous


def num_kernel_threads() -> int:
    """The thread count a C kernel called from this thread now uses."""
    return _threads.num or torch.get_num_threads()
