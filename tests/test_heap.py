"""A service process freezes what it built at start-up out of the garbage collector (specmesh/rpc/heap.py): full
collections stop walking the model's objects, and what is allocated later is still collected."""

from __future__ import annotations

import gc

from specmesh.rpc.heap import freeze_start_up_heap


class Node:
    def __init__(self) -> None:
        self.me = self          # a reference cycle: only the collector frees it


def test_start_up_objects_leave_the_collector_and_later_garbage_is_still_freed() -> None:
    built = [Node() for _ in range(5_000)]          # what start-up built (and keeps)
    try:
        line = freeze_start_up_heap()
        assert gc.get_freeze_count() >= len(built) and line.startswith("froze ")
        tracked = {id(o) for o in gc.get_objects()}     # the generations a collection walks
        assert not any(id(node) in tracked for node in built)
        freed_before = gc.get_stats()[2]["collected"]
        for _ in range(100):
            Node()                                  # garbage made while serving
        gc.collect()
        assert gc.get_stats()[2]["collected"] - freed_before >= 100
    finally:
        gc.unfreeze()
