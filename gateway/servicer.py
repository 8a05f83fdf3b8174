"""Public `Generation` servicer: validate, run the rounds, stream UTF-8-safe text, map errors to status codes."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry.context import Context
from transformers import PreTrainedTokenizerBase

from gateway.draft_pool import DraftPool
from gateway.keepalive import SessionKeepAlive
from gateway.learned_priors import LearnedPriors, PriorKey
from gateway.proposers.compose import DraftSession, request_drafting
from gateway.quotas import TenantQuotas, admit_or_abort, overload_metadata
from gateway.replicas import VerifierPool
from gateway.request_state import RequestState, RoundEvent
from gateway.request_telemetry import RequestTelemetry
from gateway.round_loop import Generation, RoundOutput
from gateway.round_outcomes import RoundOutcomes
from gateway.text_stream import TextStream
from gateway.tiers import DraftTiers, tenant_from_metadata
from gateway.upstream_errors import public_details
from gateway.validation import GenerationParams, validate_request
from protos.specmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from specmesh.config import GatewayConfig
from specmesh.engine.loop import EngineError
from specmesh.rpc.grpc_server import status_code
from specmesh.rpc.leases import new_session_id
from specmesh.rpc.security import DEFAULT_TENANT
from specmesh.telemetry.metrics import GatewayMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    eos_token_ids: frozenset[int]


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, config: GatewayConfig, tokenizer: PreTrainedTokenizerBase, model: ModelInfo,
                 verifiers: VerifierPool, draft: DraftPool | None,
                 tiers: DraftTiers | None = None, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.tiers = tiers                          # cache / n-gram tiers in front of the draft service
        self.tokenizer = tokenizer
        self.model = model
        self.verifiers = verifiers                  # replicas; placement picks one per session (gateway/placement.py)
        self.draft = draft
        self._cleanups: set[asyncio.Task[None]] = set()
        self._num_running = 0             # requests past admission and not yet ended (their generations' load hint;
                                          # a generation is counted from before its prefill)
        self.outcomes = RoundOutcomes()             # how model-drafted rounds ended (gateway-wide counters)
        self.priors = LearnedPriors() if config.learned_priors else None   # what ended requests measured
        self.quotas = TenantQuotas.from_config(config)  # per-tenant streams and queued tokens (keys file)

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        async for response in self._run(request, context):
            yield response

    async def Complete(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> generate_pb2.CompleteResponse:
        out = generate_pb2.CompleteResponse()
        async for response in self._run(request, context):
            out.request_id = response.request_id
            out.text += response.text
            out.token_ids.extend(response.token_ids)
            out.finish_reason = response.finish_reason
            if response.HasField("usage"):
                out.usage.CopyFrom(response.usage)
        return out

    async def _run(self, request: generate_pb2.GenerateRequest,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        telemetry = RequestTelemetry(self.metrics, self.model.name)   # the request id defaults to the trace id
        try:
            params = validate_request(request, self.tokenizer, self.config, self.model.max_model_len,
                                      telemetry.default_request_id)
        except EngineError as exc:
            telemetry.fail(status_code(exc.code), str(exc))
            await context.abort(status_code(exc.code), str(exc))
        tenant = tenant_from_metadata(context.invocation_metadata(), self.quotas.api_keys) or DEFAULT_TENANT
        ticket = await admit_or_abort(self.quotas, self.metrics, tenant, params, context, telemetry)   # fair share
        telemetry.started(params)
        generation = self._new_generation(params, context, telemetry.context)
        generation.session.tenant = tenant               # the verifier keeps a share for tenants holding nothing
        keepalive = SessionKeepAlive(generation, self.config.session_keepalive_s)   # a slow reader loses nothing
        keepalive.start()
        prior_key = self._prior_key(params, context)
        if self.priors is not None and generation.cost_model is not None:
            self.priors.start(prior_key, generation.cost_model, alone=self._num_running == 0)
        self._num_running += 1
        try:
            async for response in self._stream(params, generation):
                telemetry.on_response(response)
                yield response
        except grpc.aio.AioRpcError as exc:
            details = public_details("verifier", exc.details() or "", (generation.session_id,))
            telemetry.fail(exc.code(), details)
            await context.abort(exc.code(), details, overload_metadata(exc.code(), self.config.retry_after_s))
        finally:
            self._num_running -= 1
            keepalive.stop()
            ticket.release()
            telemetry.end(sys.exc_info()[1])
            self.metrics.prompt_cached_tokens.inc(generation.state.num_cached_prompt_tokens)
            if self.priors is not None and generation.cost_model is not None:
                self.priors.finish(prior_key, generation.cost_model)
            # A cancelled client must still release its KV blocks: run the cleanup as its own task.
            task = asyncio.ensure_future(generation.close())
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)

    def _prior_key(self, params: GenerationParams, context: grpc.aio.ServicerContext) -> PriorKey:
        tenant = tenant_from_metadata(context.invocation_metadata(), self.tiers.api_keys if self.tiers else None)
        return PriorKey(tenant or "", not params.sampling.is_greedy)

    def _new_generation(self, params: GenerationParams, context: grpc.aio.ServicerContext,
                        trace_context: Context | None = None) -> Generation:
        session_id = new_session_id(params.request_id)     # within the services' session id bound
        remaining = context.time_remaining()
        verifier_timeout = min(self.config.verifier_timeout_s, remaining) if remaining else \
            self.config.verifier_timeout_s
        drafting = request_drafting(self.config, params.num_draft_tokens,
                                    DraftSession(session_id, params.sampling, verifier_timeout, self.outcomes),
                                    self.draft, self.tiers,
                                    self.tiers.tenant(context.invocation_metadata()) if self.tiers else None)
        generation = Generation(params, session_id, self.verifiers, drafting.drafter, verifier_timeout,
                                trace_context, drafting.cost_model, prefetch=self.config.draft_prefetch,
                                overlap=self.config.overlap, eos_token_ids=self.model.eos_token_ids,
                                max_failovers=self.config.max_failovers, on_move=self._count_failover,
                                other_requests=lambda: self._num_running - 1)
        generation.session.cleanup_retry_s = self.config.end_session_retry_s
        generation.state.listeners.append(self._count_outcome)
        return generation

    def _count_failover(self, reason: str, old: str, new: str | None, num_emitted: int) -> None:
        self.metrics.failovers.labels(reason, "moved" if new is not None else "failed").inc()

    def _count_outcome(self, event: RoundEvent, state: RequestState) -> None:
        if event.draft.source == common_pb2.DRAFT_SOURCE_MODEL:
            self.outcomes.observe(event.draft, event.num_accepted, event.accepted_node_indices)

    async def _stream(self, params: GenerationParams,
                      generation: Generation) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The rounds' tokens as text; the generation's state cuts them at eos / max tokens, a stop string ends it."""
        text = TextStream(self.tokenizer, params.stop, params.prompt_ids)
        state = generation.state
        async for out in generation.rounds():
            tokens = out.token_ids
            delta, stopped = text.push(tokens)
            if stopped:
                tokens = state.stop_string(text.num_tokens_consumed, tokens)
            elif state.finished:
                delta += text.finish()
                if text.stopped:                     # the stop string only completed in the held-back text
                    state.stop_string_held()
            response = generate_pb2.GenerateResponse(request_id=params.request_id, text=delta, token_ids=tokens,
                                                     round=self._round_stats(out))
            if state.finished:
                response.finish_reason = state.finish_reason
                response.usage.CopyFrom(self._usage(state))
                yield response
                return
            if delta or tokens:
                yield response

    @staticmethod
    def _round_stats(out: RoundOutput) -> generate_pb2.RoundStats:
        return generate_pb2.RoundStats(round=out.round, num_drafted=out.num_drafted, num_accepted=out.num_accepted,
                                       draft_source=common_pb2.DraftSource.Name(out.draft_source))

    @staticmethod
    def _usage(state: RequestState) -> generate_pb2.Usage:
        rate = state.num_accepted / state.num_drafted if state.num_drafted else 0.0
        per_round = (state.num_accepted + state.num_rounds) / state.num_rounds if state.num_rounds else 0.0
        return generate_pb2.Usage(prompt_tokens=len(state.prompt_ids), completion_tokens=state.num_emitted,
                                  num_rounds=state.num_rounds, num_drafted_tokens=state.num_drafted,
                                  num_accepted_tokens=state.num_accepted, acceptance_rate=rate,
                                  mean_tokens_per_round=per_round)

