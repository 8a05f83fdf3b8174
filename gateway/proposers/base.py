"""What every proposer shares: the `Draft` it returns, the `Proposer` protocol behind one `propose()`, and the
`Drafter` a generation drafts with (a policy composing proposers, gateway/proposers/policy.py).

Every draft is verified the same way, so no proposer can change output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.draft_link import DraftLink
from gateway.verify_cost import UNKNOWN_COST, VerifyCost
from protos.specmesh.v1 import common_pb2
from specmesh.spec.rejection import SparseDist


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    dists: list[SparseDist] | None          # None: greedy or one-hot drafts
    source: int                             # common_pb2.DraftSource
    # A token tree: parents[i] = index of node i's parent among the drafts, -1 = a child of the pending token;
    # topological (parents[i] < i). None = a chain ([-1, 0, 1, ..., k-2]), today's drafts.
    parents: list[int] | None = None
    # (position, token): the likeliest alternative of the tree, at its least confident position (overlap drafts the
    # continuation after it while the tree is verified). None: no alternatives.
    likely_branch: tuple[int, int] | None = None


NO_DRAFT = Draft([], None, common_pb2.DRAFT_SOURCE_NONE)


class Verified(Protocol):
    """A request's verified tokens as a proposer reads them on each call; `RequestState` (their one owner) is one."""

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class VerifiedTokens:
    """A plain `Verified` (tests, benchmarks)."""
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


class Proposer(Protocol):
    """One source of drafts behind one `propose()`: the draft cache, n-gram lookup, the suffix trees (gateway/
    proposers/cache.py, ngram.py, suffix.py) and the draft model (draft_model.py). A proposer may return NO_DRAFT;
    whatever it returns is verified, so no proposer can change output. `num_tokens` is the draft model's length for
    the round, `room` the most draft tokens worth verifying now (RequestState.draft_room; None: num_tokens): local
    proposers, whose drafts are free, may fill it. `observe` is the round's outcome with the request's verified
    tokens after it (see RequestState.on_round) and what the verifier reported about its forward's cost
    (gateway/verify_cost.py)."""

    async def propose(self, context_ids: list[int], num_tokens: int, room: int | None = None) -> Draft: ...

    def observe(self, draft: Draft, num_accepted: int, verified: Verified,
                cost: VerifyCost = UNKNOWN_COST) -> None: ...


class Drafter(Proposer, Protocol):
    """What a generation drafts with: a proposer (or a policy over proposers, policy.py) that also prefills
    alongside the verifier, may prefetch the next block, and releases its sessions on close."""

    async def prefill(self, prompt_ids: list[int], num_tokens: int) -> None:
        """Runs while the verifier prefills: the draft service computes the prompt's KV and drafts ahead."""

    def prefetch(self, context_ids: list[int], draft: Draft, num_tokens: int) -> None:
        """Told when the verifier starts on `draft`: may start fetching the block after it (a guess)."""

    async def close(self) -> None: ...


class ModelProposer(Drafter, Protocol):
    """What a policy needs of the draft model (draft_model.py `ModelDrafter`): a drafter whose link backs off after
    a failure (a round that skips the model still runs the backoff down), with its traffic counters and its tree
    width, priced each round by `tree_pricing` (the round cost model's `tree_width`)."""
    link: DraftLink
    tree_width: int
    tree_pricing: Callable[[int], int] | None
    resend_in_round_max: int | None
    num_prefetch_hits: int
    bytes_sent: int
    bytes_received: int

    @property
    def prefetching(self) -> bool: ...

    async def sync(self, context_ids: list[int], num_tokens: int, backs_off: bool = False) -> None:
        """The context, outside any round, answered once the draft service has computed it (draft_model.py)."""
