"""Per-step overhead of the verifier engine over the bare model forward, and int8 kernel candidates.

    python -m bench.verifier_overhead --preset tiny --dtype int8
    python -m bench.verifier_overhead --preset qwen --dtype int8 --iters 5
    python -m bench.verifier_overhead --kernels

Two timings per batch shape, same model object, same torch threads:

(a) bare: the model's own modules (the same int8 or float linears, RoPE, norms, LM head over the same rows) on a
    rectangular batch [streams, 1 + k] of plain tensors. Attention is one SDPA call per layer over contiguous
    per-layer key/value tensors [streams, kvH, context, D] preallocated for the run (the new keys are written by
    slicing; no block pool, no block tables, no masks built per step, no scheduler, no per-request logits).
    It is the floor an engine could reach with the same numerics minus the paging and bookkeeping (its attention is
    mathematically the engine's, not bit-identical to the rowwise int8 path).
(b) step: `BatchedEngine.step()` end to end (schedule -> runner -> finish) with one queued verify per stream (on
    specmesh's own Qwen2 forward, so (a) runs on a second, unfused copy of the model; a negative overhead means the
    engine step beats transformers' bare forward): the
    scheduler's queue and KV reservation, the block-table forward, and a finish that runs the batched greedy verify
    over all requests' logits, then rolls the sequence back so every step has the same shape.

Shapes: 1 stream with 1 + k new tokens for k in 0, 4, 8; 8 streams with 1 and 1 + 4 tokens each; a prefill of 128
tokens.
Overhead % = (step - bare) / bare. Results are printed and written to bench/results/verifier-overhead-*.json.
Timings on the shared 2-core CPU are indicative only.

--kernels: one 8960 x 1536 linear (Qwen2.5-1.5B's MLP width), m = 1, 5, 16 rows, 1 thread: each candidate int8
kernel's time and whether it is batch-invariant (row 0 identical alone and in the batch).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from bench.common import fastest_s, log, result_paths, run_metadata, write_json
from specmesh.config import EngineConfig
from specmesh.engine.batched import BatchedEngine
from specmesh.engine.batched_rejection import greedy_accept
from specmesh.engine.build import build_engine_parts
from specmesh.engine.loop import EngineError
from specmesh.engine.model_runner import kv_cache_geometry
from specmesh.engine.paged_attention import ATTN_IMPLEMENTATION
from specmesh.engine.scheduled import ForwardRequest, SeqState
from specmesh.ops.launcher import PRESETS

BARE_ATTENTION = "specmesh_bare"
CONTEXT_LEN = 256


@dataclass(frozen=True)
class Shape:
    name: str
    streams: int
    new_tokens: int       # per stream; all of them get logits (a verify of new_tokens - 1 drafts)


SHAPES = (Shape("decode k=0", 1, 1), Shape("verify k=4", 1, 5), Shape("verify k=8", 1, 9),
          Shape("8 streams k=0", 8, 1), Shape("8 streams k=4", 8, 5), Shape("prefill 128", 1, 128))


# ------------------------------------------------------------------------------------------------- bare forward
class BareKV:
    """Contiguous per-layer keys/values [B, kvH, max_len, D]; `start` = tokens already there."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int) -> None:
        self.keys = [torch.randn(batch, kv_heads, max_len, head_dim) for _ in range(num_layers)]
        self.values = [torch.randn(batch, kv_heads, max_len, head_dim) for _ in range(num_layers)]
        self.start = 0
        self.mask: torch.Tensor | None = None


def bare_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   bare_kv: BareKV | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """query [B, H, q, D]; writes key/value at [start, start + q) and attends over [0, start + q)."""
    assert bare_kv is not None
    end = bare_kv.start + query.shape[2]
    k_all, v_all = bare_kv.keys[module.layer_idx], bare_kv.values[module.layer_idx]
    k_all[:, :, bare_kv.start:end] = key
    v_all[:, :, bare_kv.start:end] = value
    out = F.scaled_dot_product_attention(query, k_all[:, :, :end], v_all[:, :, :end], attn_mask=bare_kv.mask,
                                         scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(BARE_ATTENTION, bare_attention)


def bare_runner(model: Any, shape: Shape) -> Callable[[], float]:
    """A callable that runs the bare forward once and returns its seconds."""
    num_layers, kv_heads, head_dim = kv_cache_geometry(model)
    kv = BareKV(num_layers, shape.streams, kv_heads, head_dim, CONTEXT_LEN + shape.new_tokens)
    kv.start = CONTEXT_LEN - 1 if shape.new_tokens < CONTEXT_LEN // 2 else 0
    q, end = shape.new_tokens, kv.start + shape.new_tokens
    kv.mask = torch.arange(end)[None] <= torch.arange(kv.start, end)[:, None]
    ids = torch.randint(3, model.config.vocab_size, (shape.streams, q))
    positions = torch.arange(kv.start, end).expand(shape.streams, q)

    def run() -> float:
        model.set_attn_implementation(BARE_ATTENTION)
        try:
            start = time.perf_counter()
            with torch.inference_mode():
                hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False,
                                     bare_kv=kv).last_hidden_state
                model.lm_head(hidden.reshape(-1, hidden.shape[-1])).float()
            return time.perf_counter() - start
        finally:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return run


# ------------------------------------------------------------------------------------------------- engine step
class BenchEngine(BatchedEngine[ForwardRequest]):
    """The verifier's step without RPCs: greedy-verifies every finished request in one batched step, then rolls its
    sequence back so the next step has the same shape."""

    def __init__(self, parts: Any, num_threads: int) -> None:
        super().__init__("bench-verifier", parts.runner, parts.block_manager, 4096, 64, num_threads)
        self.sessions: dict[str, SeqState] = {}
        self.accepted: list[list[int]] = []
        self.filling = False          # the context's first forward: keep its KV (all but the pending token)

    def idle_seqs(self) -> list[SeqState]:
        return []

    def finish_batch(self, requests: Sequence[ForwardRequest], logits: torch.Tensor) -> None:
        self.accepted = [greedy_accept(self.argmax_rows(r), r.extra_ids) for r in requests]   # as the verifier
        for request in requests:
            if self.filling:
                request.seq.num_computed = len(request.seq.token_ids) - 1
            self.scheduler.commit(request.seq)        # num_computed unchanged: drops the new tokens' KV

    def finish(self, request: ForwardRequest, logits: torch.Tensor) -> None:
        raise AssertionError("finish_batch handles every request")

    def fail(self, request: ForwardRequest, exc: EngineError) -> None:
        raise exc


def step_runner(parts: Any, shape: Shape, num_threads: int) -> tuple[Callable[[], float], Callable[[], None]]:
    """(a callable that runs one engine step and returns its seconds, cleanup)."""
    engine = BenchEngine(parts, num_threads)
    vocab = parts.loaded.model.config.vocab_size
    requests = []
    prefill = shape.new_tokens >= CONTEXT_LEN // 2
    for s in range(shape.streams):
        context = torch.randint(3, vocab, (shape.new_tokens if prefill else CONTEXT_LEN,)).tolist()
        seq = SeqState(s, context, num_verified=len(context))
        drafts = [] if prefill else torch.randint(3, vocab, (shape.new_tokens - 1,)).tolist()
        requests.append(ForwardRequest(seq, drafts, len(drafts) + 1))
        engine.sessions[str(s)] = seq
    engine.filling = True
    for r in requests:        # fill the context's KV once (all but the pending token)
        if not prefill:
            engine.scheduler.enqueue(ForwardRequest(r.seq, [], 1))
            engine.step()
    engine.filling = False

    def run() -> float:       # a prefill's sequence keeps num_computed = 0: every run recomputes the whole prompt
        for r in requests:
            engine.scheduler.enqueue(r)
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    def cleanup() -> None:
        for r in requests:
            engine.scheduler.release(r.seq)
    return run, cleanup


def paired(runs: Sequence[Callable[[], float]], iters: int) -> list[float]:
    """Each run's fastest of `iters` calls, the runs interleaved, after one warm-up call each (on a loaded shared
    machine the minimum is the least noisy estimate of a call's own cost; interleaving spreads load drift)."""
    samples: list[list[float]] = [[] for _ in runs]
    for i in range(iters + 1):
        for run, out in zip(runs, samples, strict=True):
            seconds = run()
            if i:
                out.append(seconds)
    return [min(s) for s in samples]


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(model=PRESETS[args.preset][0], dtype=args.dtype, num_threads=args.threads,
                          num_kv_blocks=(CONTEXT_LEN + 256) * 8 // 16 + 64)
    parts = build_engine_parts(config)
    # the bare forward runs transformers' modules, so it needs a model with unfused projections: a second copy
    bare_model = parts.loaded.model if parts.runner.decoder is None else build_engine_parts(
        dataclasses.replace(config, forward="transformers")).loaded.model
    torch.set_num_threads(args.threads)
    rows = []
    for shape in SHAPES:
        iters = max(2, args.iters // 4) if shape.new_tokens >= CONTEXT_LEN // 2 else args.iters
        step_run, cleanup = step_runner(parts, shape, args.threads)
        bare, step = paired([bare_runner(bare_model, shape), step_run], iters)
        cleanup()
        row = {"shape": shape.name, "streams": shape.streams, "new_tokens": shape.new_tokens,
               "bare_ms": bare * 1e3, "step_ms": step * 1e3, "overhead_pct": 100 * (step - bare) / bare}
        log(f"{shape.name:>16}: bare {row['bare_ms']:8.2f} ms  step {row['step_ms']:8.2f} ms  "
            f"overhead {row['overhead_pct']:+6.1f}%")
        rows.append(row)
    return {"preset": args.preset, "dtype": args.dtype, "threads": args.threads, "context_len": CONTEXT_LEN,
            "step_forward": "specmesh" if parts.runner.decoder is not None else "transformers", "shapes": rows}


# ------------------------------------------------------------------------------------------------- kernels
def kernel_candidates(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from specmesh.engine.int8_linear import Int8PerTokenLinear, Int8RowwiseIntMM

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    per_token = Int8PerTokenLinear(linear)
    int_mm = Int8RowwiseIntMM(linear)
    dynamic = torch.ao.nn.quantized.dynamic.Linear.from_float(
        _with_qconfig(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False), weight))
    w_scale = weight.abs().amax(1) / 127
    w_int8 = torch.round(weight / w_scale[:, None]).to(torch.int8)
    candidates: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "int8_linear.py (fbgemm u8s8, per-row act scale)": per_token,
        "fbgemm linear_dynamic (per-tensor act scale)": dynamic,
        "torch._int_mm + per-row scales": int_mm,
        "torch._weight_int8pack_mm (fp32 act)": lambda x: torch._weight_int8pack_mm(x, w_int8, w_scale),
        "fp32 F.linear": lambda x: F.linear(x, weight),
    }
    try:
        candidates["torch.compile(_int_mm + per-row scales)"] = torch.compile(int_mm.forward, dynamic=True)
    except Exception as exc:       # noqa: BLE001 - a missing compiler is a result, not a crash
        log(f"torch.compile unavailable: {exc!r}")
    return candidates


def _with_qconfig(linear: torch.nn.Linear, weight: torch.Tensor) -> torch.nn.Linear:
    linear.weight.data.copy_(weight)
    linear.qconfig = torch.ao.quantization.default_dynamic_qconfig
    return linear


def kernels(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(8960, 1536, generator=g) * 0.02
    x_all = torch.randn(16, 1536, generator=g)
    rows = []
    for name, fn in kernel_candidates(weight).items():
        try:
            invariant = all(torch.equal(fn(x_all[:m])[0], fn(x_all[:1])[0]) for m in (5, 16))
            times = {m: fastest_s(lambda m=m, fn=fn: fn(x_all[:m]), args.iters) * 1e3 for m in (1, 5, 16)}
        except Exception as exc:   # noqa: BLE001 - an unsupported kernel is a result
            log(f"{name}: failed: {exc!r}")
            rows.append({"kernel": name, "error": repr(exc)})
            continue
        log(f"{name:>48}: m=1 {times[1]:7.3f} ms  m=5 {times[5]:7.3f} ms  m=16 {times[16]:7.3f} ms  "
            f"batch-invariant: {invariant}")
        rows.append({"kernel": name, "ms": times, "batch_invariant": invariant})
    return {"linear": [8960, 1536], "threads": 1, "kernels": rows}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--dtype", default="int8", choices=["int8", "int4", "float32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kernels", action="store_true", help="time int8 linear kernels instead")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    payload = kernels(args) if args.kernels else overhead(args)
    payload["meta"] = run_metadata(args)
    name = "verifier-kernels" if args.kernels else f"verifier-overhead-{args.preset}-{args.dtype}-t{args.threads}"
    write_json(result_paths(name)[0], payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
