"""The engine's error type, on its own so plain-int modules (the scheduler) import no telemetry or torch."""

from __future__ import annotations


class EngineError(Exception):
    """An error to report to the caller with a gRPC status name (e.g. 'RESOURCE_EXHAUSTED', 'NOT_FOUND')."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ForwardInterrupted(Exception):
    """A forward gave way between layers to more urgent work (its results are dropped; see ModelRunner.interrupt)."""
