"""A model engine on its own thread: asyncio callers submit work items and await futures.

Model work never runs on the event loop. The engine thread wakes when work arrives, runs one `step()` (one batched
forward), resolves the futures of the items that finished, and sleeps when there is nothing to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from opentelemetry import trace

from specmesh.engine.errors import EngineError

log = logging.getLogger(__name__)

__all__ = ["Completion", "EngineError", "EngineThread"]

T = TypeVar("T")


class Completion(Generic[T]):
    """The asyncio side of one work item, resolved from the engine thread with a T."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.future: asyncio.Future[T] = self._loop.create_future()
        # The submitting caller's span (the RPC's server span): the engine's forward span links to it.
        self.span_context = trace.get_current_span().get_span_context()
        self.submitted_at = time.monotonic()      # the engine measures how long the work waited behind prefill

    def _set(self, fn: Callable[[], None]) -> None:
        if not self.future.done():
            fn()

    def set_result(self, value: T) -> None:
        self._loop.call_soon_threadsafe(self._set, lambda: self.future.set_result(value))

    def set_exception(self, exc: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._set, lambda: self.future.set_exception(exc))


class EngineThread:
    """Owns all engine state on one thread. Other threads only `post()` messages to its inbox.

    Subclasses implement `handle(message)` (apply a submitted message to the state), `has_work()` and `step()`.
    Because only the engine thread touches the state, no lock is held during a forward and the event loop never
    waits on the model.
    """

    def __init__(self, name: str, num_threads: int) -> None:
        self._name = name
        self._num_threads = num_threads
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def post(self, message: Any) -> None:
        self._inbox.put(message)

    def handle(self, message: Any) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def gather_wait_s(self) -> float:
        """Seconds to wait for more work before the next step (work expected any moment that should share it)."""
        return 0.0

    def fail_all(self, exc: BaseException) -> None:
        """Fail every pending item (last resort after a crash that escaped step())."""
        raise NotImplementedError

    def _drain(self, block: bool, timeout: float | None = None) -> None:
        """Handles the inbox's messages; block: waits for the first (up to `timeout`, then queue.Empty)."""
        message = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        while True:
            if message is not None:
                self._handle_safely(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle_safely(self, message: Any) -> None:
        """Subclasses answer their own messages' errors; anything that still escapes is logged, never fatal."""
        try:
            self.handle(message)
        except Exception:
            log.exception("%s failed to handle %s", self._name, type(message).__name__)

    def _run(self) -> None:
        import torch

        torch.set_num_threads(self._num_threads)
        while not self._stopped.is_set():
            with contextlib.suppress(queue.Empty):
                self._drain(block=not self.has_work())
            if self._stopped.is_set() or not self.has_work():
                continue
            wait_s = self.gather_wait_s()
            if wait_s > 0:                # the next message, or the wait's end: then decide again
                with contextlib.suppress(queue.Empty):
                    self._drain(block=True, timeout=wait_s)
                continue
            try:
                self.step()
            except Exception as exc:  # last resort (step() isolates request faults itself): never hang callers
                log.exception("%s step failed", self._name)
                self.fail_all(EngineError("INTERNAL", f"engine step failed: {exc}"))
