"""What the verifier engine's event loop and scheduler queue carry: the messages from the servicer (start, verify,
end) and a session's queued work item (`VerifyRequest`: a start, a verify, or a step decoding ahead)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from opentelemetry.trace import SpanContext

from specmesh.engine.loop import Completion
from specmesh.engine.scheduled import ForwardRequest
from specmesh.spec.rejection import SparseDist
from specmesh.spec.sampling import SamplingParams
from verifier_service.forward_share import VerifyResult
from verifier_service.session import Session


@dataclass(frozen=True)
class Start:
    session_id: str
    prompt_ids: list[int]
    params: SamplingParams
    done: Completion[VerifyResult]
    deadline: float | None = None
    max_new_tokens: int = 0
    speculative: bool = False


@dataclass(frozen=True)
class Verify:
    session_id: str
    draft_ids: list[int]
    draft_dists: list[SparseDist] | None
    done: Completion[VerifyResult]
    deadline: float | None = None
    draft_parents: list[int] | None = None     # a token tree (None = chain)
    model_drafts: bool = True                  # made by the draft service (which may be drafting the next block now)


@dataclass(frozen=True)
class Drafts:
    """What a queued verify checks: the drafts' q and, for a tree, its shape and the request's node indices."""

    dists: list[SparseDist] | None
    parents: list[int] | None = None
    node_indices: list[int] | None = None      # kept node -> its index in the request (nodes past the context drop)
    ahead_path: tuple[int, ...] = ()           # request nodes already accepted against tokens decoded ahead
    is_ahead_step: bool = False                # no caller: decoding ahead (greedy), after any guesses


class Caller(Protocol):
    """Who waits for a queued request's answer: the verify's `Completion`, or nobody (`NoCaller`)."""

    @property
    def span_context(self) -> SpanContext | None: ...

    @property
    def submitted_at(self) -> float | None: ...

    def set_result(self, value: VerifyResult) -> None: ...

    def set_exception(self, exc: BaseException) -> None: ...


class NoCaller:
    """The completion of a decode-ahead step: nobody waits for it."""

    span_context = None
    submitted_at = None

    def set_result(self, value: VerifyResult) -> None:
        pass

    def set_exception(self, exc: BaseException) -> None:
        pass


AHEAD_STEP = Drafts(None, is_ahead_step=True)
NO_CALLER = NoCaller()


@dataclass(kw_only=True)
class VerifyRequest(ForwardRequest):
    """A session's work in the scheduler's queue: its start (a verify of no drafts), a verify, or a step decoding
    ahead."""

    session: Session
    drafts: Drafts
    done: Caller


@dataclass(frozen=True)
class End:
    session_id: str
