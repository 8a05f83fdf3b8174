"""Keeps Python's cyclic garbage collector off what a service built at start-up.

A model service holds ~400k objects the collector tracks once it is built (torch modules and parameters, the
transformers config and tokenizer, gRPC): a full (oldest-generation) collection walks all of them, 150-195 ms for
the 1.5B int4 verifier, the draft service and the gateway alike on a 2-core Zen 3, with the GIL held, on whichever
Python thread allocated last. For that long the engine thread stops between two kernels and a core is taken from
the step's compute threads: one stall of every stream in that step. Such a collection comes rarely (once the
objects surviving since the last one reach a quarter of the heap), but its cost grows with the model. gc.freeze()
after start-up moves those objects to a permanent generation no collection visits (as vLLM's and SGLang's servers do
after loading a model), so a full collection walks only what serving allocated since; that is collected as before.
"""

from __future__ import annotations

import gc
import time


def freeze_start_up_heap() -> str:
    """Collects start-up garbage (a frozen object is never freed), then freezes every object left; a log line."""
    started = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - started) * 1e3
    gc.freeze()
    return (f"froze {gc.get_freeze_count():,} start-up objects out of the garbage collector (a full collection "
            f"of them took {full_ms:.0f} ms)")
