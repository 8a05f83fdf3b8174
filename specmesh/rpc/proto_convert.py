"""Conversion between protobuf messages and the plain types the engines use (done at the service edge)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from google.protobuf import unknown_fields

from protos.specmesh.v1 import common_pb2
from specmesh.engine.loop import EngineError
from specmesh.spec.rejection import SparseDist
from specmesh.spec.sampling import SamplingParams

MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 1024


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Validates and converts; errors are INVALID_ARGUMENT naming the field. A field this build does not know (a
    newer peer's sampling option) is refused too: ignoring it would sample from another distribution."""
    fields = unknown_fields.UnknownFieldSet(msg)
    unknown = [fields[i].field_number for i in range(len(fields))]
    if unknown:
        raise EngineError("INVALID_ARGUMENT", f"sampling has field number {unknown[0]}, which this server does not "
                          "know (a newer specmesh.v1?); it would be ignored")
    if not math.isfinite(msg.temperature) or msg.temperature < 0:
        raise EngineError("INVALID_ARGUMENT", f"sampling.temperature must be >= 0, got {msg.temperature}")
    if msg.temperature > 100:
        raise EngineError("INVALID_ARGUMENT", f"sampling.temperature must be <= 100, got {msg.temperature}")
    top_p = msg.top_p if msg.top_p != 0 else 1.0
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise EngineError("INVALID_ARGUMENT", f"sampling.top_p must be in (0, 1], got {msg.top_p}")
    seed = msg.seed if msg.HasField("seed") else None
    if seed is not None and seed > MAX_SEED:
        raise EngineError("INVALID_ARGUMENT", f"sampling.seed must be < 2^63, got {seed}")
    if not (math.isfinite(msg.min_p) and 0 <= msg.min_p <= 1):
        raise EngineError("INVALID_ARGUMENT", f"sampling.min_p must be in [0, 1], got {msg.min_p}")
    penalty = msg.repetition_penalty if msg.repetition_penalty != 0 else 1.0
    if not (math.isfinite(penalty) and 0 < penalty <= 100):
        raise EngineError("INVALID_ARGUMENT",
                          f"sampling.repetition_penalty must be in (0, 100], got {msg.repetition_penalty}")
    return SamplingParams(temperature=float(msg.temperature), top_p=float(top_p), top_k=int(msg.top_k), seed=seed,
                          min_p=float(msg.min_p), repetition_penalty=float(penalty),
                          logit_bias=_logit_bias(msg.logit_bias))


def _logit_bias(entries: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
    if len(entries) > MAX_LOGIT_BIAS:
        raise EngineError("INVALID_ARGUMENT", f"sampling.logit_bias has {len(entries)} entries; the limit is "
                          f"{MAX_LOGIT_BIAS}")
    for token, bias in entries.items():
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise EngineError("INVALID_ARGUMENT", f"sampling.logit_bias[{token}] must be in [-100, 100], got {bias}")
    return tuple(sorted((int(t), float(b)) for t, b in entries.items() if b != 0))


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                    min_p=params.min_p, logit_bias=dict(params.logit_bias))
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sparse_dists_from_proto(msgs: Sequence[common_pb2.SparseDist], num_drafts: int,
                            vocab_size: int) -> list[SparseDist] | None:
    if not msgs:
        return None
    if len(msgs) != num_drafts:
        raise EngineError("INVALID_ARGUMENT", f"draft_dists has {len(msgs)} entries for {num_drafts} draft tokens")
    dists = []
    for i, msg in enumerate(msgs):
        try:
            dist = SparseDist(tuple(msg.token_ids), tuple(msg.probs))
        except ValueError as exc:
            raise EngineError("INVALID_ARGUMENT", f"draft_dists[{i}]: {exc}") from None
        if max(dist.token_ids) >= vocab_size:
            raise EngineError("INVALID_ARGUMENT", f"draft_dists[{i}]: token id >= vocab size {vocab_size}")
        total = sum(dist.probs)
        if total <= 0:
            raise EngineError("INVALID_ARGUMENT", f"draft_dists[{i}]: probabilities sum to 0")
        dists.append(SparseDist(dist.token_ids, tuple(p / total for p in dist.probs)))
    return dists


def sparse_dists_to_proto(dists: Sequence[SparseDist]) -> list[common_pb2.SparseDist]:
    return [common_pb2.SparseDist(token_ids=list(d.token_ids), probs=list(d.probs)) for d in dists]
