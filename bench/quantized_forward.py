"""The verifier's forward per numerics (int8, int4, optionally float32), through the engine's own ModelRunner: ms per
forward of k new tokens after a 100-token context at 1 and 2 threads, and top-1 agreement with the float32 model
(the GGUF file's own weights, dequantized) teacher-forced over workload text.

    .venv/bin/python -m bench.quantized_forward --preset qwen2.5-coder-1.5b           # ~4 min, ~8 GB RAM
    .venv/bin/python -m bench.quantized_forward --preset tiny-target --dtypes int8,int4 --agreement-tokens 0
    .venv/bin/python -m bench.quantized_forward --preset qwen2.5-coder-0.5b --dtypes int4 \
        --forwards specmesh,transformers --threads 1 --agreement-tokens 0  # own forward vs transformers'

Prints a table and writes bench/results/quantized-forward-<preset>-<time>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.common import DEFAULT_WORKLOAD, load_workload, log, split_csv
from specmesh.config import EngineConfig
from specmesh.engine import int4_kernel
from specmesh.engine.build import build_engine_parts
from specmesh.engine.model_runner import ForwardItem, ModelRunner
from specmesh.models import resolve_model_dir

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CONTEXT = 100
BLOCK = 16


def forward_ms(runner: ModelRunner, context: list[int], k: int, reps: int) -> float:
    """Median ms of one forward of k new tokens at position len(context) (the same slots rewritten each time)."""
    table = list(range(-(-(len(context) + k) // BLOCK)))
    runner.forward([ForwardItem(context, 0, table, 1)])
    new = (context * (k // len(context) + 1))[:k]      # k may exceed the context
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        runner.forward([ForwardItem(new, len(context), table, k)])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def top1(runner: ModelRunner, ids: list[int], chunk: int = 0) -> torch.Tensor:
    """argmax after every position of `ids`, teacher-forced: one prefill, or prefills of `chunk` tokens (bounding the
    logits held at once)."""
    table = list(range(-(-len(ids) // BLOCK)))
    step = chunk or len(ids)
    return torch.cat([runner.forward([ForwardItem(ids[s:s + step], s, table, len(ids[s:s + step]))])[0].argmax(-1)
                      for s in range(0, len(ids), step)])


def text_ids(tokenizer, num_tokens: int) -> list[int]:
    ids: list[int] = []
    for prompt in load_workload(DEFAULT_WORKLOAD):
        ids.extend(tokenizer(prompt.prompt)["input_ids"])
        if len(ids) >= num_tokens:
            break
    return ids[:num_tokens]


def measure(preset: str, dtype: str, ks: list[int], threads: list[int], reps: int, ids: list[int],
            label: str = "", forward: str = "specmesh") -> dict:
    parts = build_engine_parts(EngineConfig(model=preset, dtype=dtype, num_kv_blocks=64, block_size=BLOCK,
                                            forward=forward))
    context = (ids * (1 + CONTEXT // max(1, len(ids))))[:CONTEXT] if ids else list(range(3, 3 + CONTEXT))
    costs = {}
    for t in threads:
        torch.set_num_threads(t)
        costs[t] = {k: forward_ms(parts.runner, context, k, reps) for k in ks}
        log(f"{label or dtype} {t} thread(s): " + "  ".join(f"k={k} {ms:.1f} ms" for k, ms in costs[t].items()))
    torch.set_num_threads(1)
    argmax = top1(parts.runner, ids) if ids else None
    return {"costs_ms": costs, "argmax": argmax}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtypes", default="int8,int4", help="comma list; float32 is added for the agreement column")
    p.add_argument("--ks", default="1,2,4,5,8,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--int4-isas", default="", help="int4 code paths to time, e.g. avx2,avx512vnni,amx (default: "
                   "every one this CPU has; outputs are bit-identical across them)")
    p.add_argument("--forwards", default="specmesh", help="comma list of model forwards to time: specmesh (its own "
                   "Qwen2 forward), transformers (theirs, same kernels); rows of the second get a /transformers label")
    p.add_argument("--agreement-tokens", type=int, default=400, help="teacher-forced tokens compared (0 = skip)")
    args = p.parse_args(argv)
    dtypes = split_csv(args.dtypes)
    ks, threads = [int(k) for k in split_csv(args.ks)], [int(t) for t in split_csv(args.threads)]
    ids: list[int] = []
    if args.agreement_tokens:
        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.preset)))   # no model load for it
        ids = text_ids(tokenizer, args.agreement_tokens)
        if "float32" not in dtypes:
            dtypes = [*dtypes, "float32"]
    results = {}
    forwards = split_csv(args.forwards)
    for dtype in dtypes:
        for isa in (int4_isas(args.int4_isas) if dtype == "int4" else [""]):
            for forward in (forwards if dtype != "float32" else forwards[:1]):
                label = (f"{dtype}/{isa}" if isa else dtype) + ("" if forward == "specmesh" else f"/{forward}")
                if isa:
                    int4_kernel.instruction_set(isa)
                results[label] = measure(args.preset, dtype, ks, threads if dtype != "float32" else [], args.reps,
                                         ids, label, forward)
                gc.collect()
    reference = results.get("float32", {}).get("argmax")
    report = {"preset": args.preset, "context": CONTEXT, "ks": ks, "threads": threads, "agreement_tokens": len(ids),
              "dtypes": {}}
    for dtype, r in results.items():
        entry = {"costs_ms": r["costs_ms"]}
        if reference is not None and dtype != "float32":
            entry["top1_agreement_with_float32"] = float((r["argmax"] == reference).float().mean())
        report["dtypes"][dtype] = entry
    print_table(report)
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"quantized-forward-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2))
    log(f"wrote {out}")
    return 0


def int4_isas(wanted: str) -> list[str]:
    """The int4 kernel paths to time: those asked for, or every one the CPU has (best first)."""
    names = split_csv(wanted) or list(reversed(int4_kernel.ISAS))
    runnable = [name for name in names if int4_kernel.instruction_set(name) == name]
    int4_kernel.instruction_set(None if not runnable else runnable[0])
    return runnable


def print_table(report: dict) -> None:
    print(f"\n{report['preset']}: ms per forward of k new tokens after {report['context']} tokens")
    head = "  ".join(f"k={k:<5}" for k in report["ks"])
    print(f"{'dtype':28} threads  {head}  top-1 vs float32")
    for dtype, entry in report["dtypes"].items():
        agree = entry.get("top1_agreement_with_float32")
        for t, costs in entry["costs_ms"].items():
            row = "  ".join(f"{costs[k]:7.1f}" for k in report["ks"])
            print(f"{dtype:28} {t:7}  {row}  {'' if agree is None else f'{agree:.3f}'}")


if __name__ == "__main__":
    raise SystemExit(main())
