"""One generation: prefill on the verifier, then draft -> verify rounds until a stop condition.

Only verified tokens leave this loop. Text is produced by the caller from the yielded tokens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from gateway.drafters import NO_DRAFT, ModelDrafter
from gateway.validation import GenerationParams
from protos.specmesh.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specmesh.proto_convert import sampling_to_proto, sparse_dists_to_proto

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundOutput:
    round: int                 # 0 = the prefill's first token
    token_ids: list[int]       # newly verified tokens (not yet cut at eos / max tokens)
    num_drafted: int
    num_accepted: int
    draft_source: int


class Generation:
    """Drives one request's session on the verifier (and draft service). Always `close()` it."""

    def __init__(self, params: GenerationParams, session_id: str, verifier: verifier_pb2_grpc.VerifierStub,
                 drafter: ModelDrafter | None, verifier_timeout_s: float) -> None:
        self.params = params
        self.session_id = session_id
        self.verifier = verifier
        self.drafter = drafter
        self.timeout_s = verifier_timeout_s
        self.output_ids: list[int] = []
        self.num_cached_prompt_tokens = 0

    async def rounds(self) -> AsyncIterator[RoundOutput]:
        start = await self.verifier.StartSession(verifier_pb2.StartSessionRequest(
            session_id=self.session_id, prompt_token_ids=self.params.prompt_ids,
            sampling=sampling_to_proto(self.params.sampling), max_new_tokens=self.params.max_new_tokens),
            timeout=self.timeout_s)
        self.num_cached_prompt_tokens = start.num_cached_prompt_tokens
        self.output_ids.append(start.first_token_id)
        yield RoundOutput(0, [start.first_token_id], 0, 0, common_pb2.DRAFT_SOURCE_NONE)
        round_index = 0
        while True:
            round_index += 1
            remaining = self.params.max_new_tokens - len(self.output_ids)
            # Drafting past the last token the client can receive is wasted work.
            num_draft = min(self.params.num_draft_tokens, max(remaining - 1, 0))
            context = self.params.prompt_ids + self.output_ids
            draft = await self.drafter.propose(context, num_draft) if self.drafter else NO_DRAFT
            result = await self.verifier.Verify(verifier_pb2.VerifyRequest(
                session_id=self.session_id, draft_token_ids=draft.token_ids,
                draft_dists=sparse_dists_to_proto(draft.dists or [])), timeout=self.timeout_s)
            tokens = list(result.token_ids)
            self.output_ids.extend(tokens)
            yield RoundOutput(round_index, tokens, len(draft.token_ids), result.num_accepted, draft.source)

    async def close(self) -> None:
        """Release the session everywhere; runs even when the client went away."""
        calls = [self.verifier.EndSession(common_pb2.EndSessionRequest(session_id=self.session_id), timeout=5.0)]
        if self.drafter is not None:
            calls.append(self.drafter.close())
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, grpc.aio.AioRpcError):
                log.warning("ending session %s: %s", self.session_id, r.details())
