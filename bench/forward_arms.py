"""Two ways of running the same forward, timed in alternating rounds in one process (the same model object and KV
slots), so the machine's drift falls on both arms: the shared loop of bench.huge_pages and bench.kernel_pool."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Mapping, Sequence

import torch

from bench.common import log
from bench.quantized_forward import BLOCK, forward_ms
from specmesh.config import EngineConfig
from specmesh.engine.build import EngineParts, build_engine_parts
from specmesh.engine.model_runner import ForwardItem, ModelRunner

Times = dict[str, dict[int, list[float]]]       # arm -> k -> ms per round


def add_arm_args(p: argparse.ArgumentParser, ks: str = "1,8,32", rounds: int = 5) -> None:
    """The flags every alternating-arms bench takes."""
    p.add_argument("--preset", default="qwen2.5-coder-1.5b")
    p.add_argument("--ks", default=ks, help="new tokens per forward")
    p.add_argument("--context", type=int, default=100, help="tokens already in the KV cache")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=rounds, help="rounds of both arms, alternating")
    p.add_argument("--reps", type=int, default=15, help="forwards per arm, k and round (their median counts)")
    p.add_argument("--name", default="")


def int4_parts(args: argparse.Namespace, ks: Sequence[int]) -> EngineParts:
    """The int4 engine at --preset and --threads with a KV pool just large enough for --context + max(ks)."""
    return build_engine_parts(EngineConfig(model=args.preset, dtype="int4", num_threads=args.threads,
                                           num_kv_blocks=-(-(args.context + max(ks)) // BLOCK) + 1,
                                           block_size=BLOCK))


def context_ids(num_tokens: int) -> list[int]:
    """The token ids already in the KV cache before the timed forwards (any ids: the timing does not read them)."""
    return [3 + i % 1000 for i in range(num_tokens)]


def logits_of(runner: ModelRunner, context: list[int]) -> torch.Tensor:
    table = list(range(-(-(len(context) + 1) // BLOCK)))
    return runner.forward([ForwardItem(context, 0, table, 1)])[0]


def alternate(arms: Mapping[str, Callable[[], None]], runner: ModelRunner, context: list[int], ks: Sequence[int],
              rounds: int, reps: int) -> Times:
    """Each round: every arm (set up by its callable, order reversed every other round) times a forward of k new
    tokens after `context` for each k (median of `reps`). Raises SystemExit if an arm changes the logits."""
    reference = logits_of(runner, context)
    times: Times = {arm: {k: [] for k in ks} for arm in arms}
    names = list(arms)
    for round_index in range(rounds):
        for arm in (reversed(names) if round_index % 2 else names):
            arms[arm]()
            for k in ks:
                times[arm][k].append(forward_ms(runner, context, k, reps))
            if not torch.equal(logits_of(runner, context), reference):
                raise SystemExit(f"{arm}: the logits changed")
        log(f"round {round_index + 1}: " + "  ".join(
            f"k={k} " + " / ".join(f"{arm} {times[arm][k][-1]:.1f}" for arm in names) + " ms" for k in ks))
    return times


def ratio_rows(times: Times, slow: str, fast: str) -> dict[int, dict[str, float]]:
    """Per k: each arm's median ms over rounds and the median of the per-round ratio slow / fast."""
    return {k: {f"{fast}_ms": statistics.median(times[fast][k]), f"{slow}_ms": statistics.median(times[slow][k]),
                f"{slow}_over_{fast}": statistics.median(s / f for s, f in zip(times[slow][k], times[fast][k],
                                                                                 strict=True))}
            for k in times[fast]}


def print_rows(rows: dict[int, dict[str, float]], slow: str, fast: str, rounds: int) -> None:
    for k, row in rows.items():
        print(f"k={k:<4} {fast} {row[f'{fast}_ms']:7.1f} ms   {slow} {row[f'{slow}_ms']:7.1f} ms   {slow} / {fast} "
              f"{row[f'{slow}_over_{fast}']:.3f} (median of {rounds} rounds)")
