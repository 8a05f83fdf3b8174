"""Prompt-lookup guesses in a model's free rows (specmesh/engine/guesses.py) measured alone: greedy decoding of workload
prompts through the engine's own ModelRunner, one token per forward and then with guesses priced as the services
price them (the verifier while it decodes ahead, the draft service while it drafts), paired per prompt. Reports
tokens per forward, tok/s, the ratio, and whether the two outputs are identical (they must be).

    .venv/bin/python -m bench.guess_gain --preset qwen2.5-coder-1.5b              # target, 1 thread, ~6 min
    .venv/bin/python -m bench.guess_gain --preset qwen2.5-coder-0.5b              # draft
    .venv/bin/python -m bench.guess_gain --preset tiny-target --dtype int8 --max-new-tokens 16 --limit 1

Prints a table and writes bench/results/guess-gain-<preset>-<time>.json. Exit code 1 when an output differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.common import DEFAULT_WORKLOAD, SPLITS, Prompt, load_workload, log, split_arg, split_csv
from specmesh.config import EngineConfig
from specmesh.engine.batched_rejection import greedy_accept
from specmesh.engine.build import build_engine_parts
from specmesh.engine.forward_cost import ForwardCost
from specmesh.engine.guesses import MAX_GUESSES, GuessRate, best_num_guesses, guess
from specmesh.engine.model_runner import ForwardItem, ModelRunner
from specmesh.models import resolve_model_dir

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BLOCK = 16


def decode(runner: ModelRunner, prompt_ids: list[int], max_new_tokens: int, eos_ids: frozenset[int],
           with_guesses: bool) -> dict:
    """Greedy tokens after prompt_ids; decode seconds (after the prefill's first token) and forwards."""
    table = list(range(-(-(len(prompt_ids) + max_new_tokens + MAX_GUESSES + 1) // BLOCK)))
    logits = runner.forward([ForwardItem(prompt_ids, 0, table, 1)])[0]
    out = [int(logits[-1].argmax())]
    rate, cost = GuessRate(), ForwardCost()
    threads = torch.get_num_threads()
    num_forwards = num_guessed = 0
    started = time.perf_counter()
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        context = prompt_ids + out
        room = max_new_tokens - len(out) - 1
        g = best_num_guesses(rate.rate, cost.fit(threads), 1, room) if with_guesses else 0
        guesses = guess(context, g, eos_ids) if g else []
        t0 = time.perf_counter()
        rows = runner.forward([ForwardItem([out[-1], *guesses], len(context) - 1, table, len(guesses) + 1)])[0]
        cost.observe(len(guesses) + 1, threads, time.perf_counter() - t0)
        emitted = greedy_accept(rows.argmax(-1).tolist(), guesses)
        rate.observe(len(guesses), len(emitted) - 1)
        out += emitted
        num_forwards += 1
        num_guessed += len(guesses)
    seconds = time.perf_counter() - started
    out = out[:max_new_tokens]
    if any(t in eos_ids for t in out):
        out = out[:next(i for i, t in enumerate(out) if t in eos_ids) + 1]
    return {"token_ids": out, "decode_s": seconds, "forwards": num_forwards, "guessed": num_guessed}


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """The prompt as the gateway sends it: through the chat template where the tokenizer has one."""
    text = prompt.prompt
    if tokenizer.chat_template:
        messages = [{"role": role, "content": content} for role, content in prompt.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="int4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--categories", default="chat,summarize,code,code-edit")
    p.add_argument("--limit", type=int, default=2, help="prompts per category and split")
    p.add_argument("--split", default="", choices=["", *SPLITS], help="tune or eval prompts only (default: both)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.preset)))
    parts = build_engine_parts(EngineConfig(model=args.preset, dtype=args.dtype, num_kv_blocks=256, block_size=BLOCK))
    eos_ids = frozenset(parts.loaded.eos_token_ids)
    rows, mismatches = [], 0
    prompts = load_workload(args.workload, split_csv(args.categories), True, args.limit, split_arg(args))
    for i, prompt in enumerate(prompts):
        ids = prompt_ids(tokenizer, prompt)
        order = (False, True) if i % 2 == 0 else (True, False)      # alternate which runs first (drift)
        runs = {g: decode(parts.runner, ids, args.max_new_tokens, eos_ids, g) for g in order}
        plain, guessed = runs[False], runs[True]
        same = plain["token_ids"] == guessed["token_ids"]
        mismatches += not same
        n = len(plain["token_ids"]) - 1
        row = {"id": prompt.id, "category": prompt.category, "decode_tokens": n, "identical": same,
               "plain_tok_s": n / plain["decode_s"] if plain["decode_s"] else 0.0,
               "guess_tok_s": n / guessed["decode_s"] if guessed["decode_s"] else 0.0,
               "plain_forwards": plain["forwards"], "guess_forwards": guessed["forwards"],
               "guessed": guessed["guessed"]}
        row["speedup"] = row["guess_tok_s"] / row["plain_tok_s"] if row["plain_tok_s"] else 0.0
        rows.append(row)
        log(f"{prompt.id:28} {n:4} tokens  plain {row['plain_tok_s']:6.2f} tok/s  guesses {row['guess_tok_s']:6.2f} "
            f"({row['speedup']:.2f}x, {n / max(1, guessed['forwards']):.2f} tokens/forward)"
            + ("" if same else "  !!! outputs differ"))
    report = {"preset": args.preset, "dtype": args.dtype, "threads": args.threads,
              "max_new_tokens": args.max_new_tokens, "rows": rows, "categories": summarize(rows)}
    print_table(report)
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"guess-gain-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2))
    log(f"wrote {out}")
    return 1 if mismatches else 0


def summarize(rows: list[dict]) -> dict:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by[r["category"]].append(r)
        by["overall"].append(r)
    def tokens_per_forward(rs: list[dict]) -> float:
        return sum(r["decode_tokens"] for r in rs) / max(1, sum(r["guess_forwards"] for r in rs))

    return {c: {"n": len(rs), "median_speedup": statistics.median(r["speedup"] for r in rs),
                "tokens_per_forward": tokens_per_forward(rs), "identical": all(r["identical"] for r in rs)}
            for c, rs in by.items()}


def print_table(report: dict) -> None:
    print(f"\n{report['preset']} {report['dtype']}, {report['threads']} thread(s): greedy decoding with prompt-lookup "
          f"guesses vs one token per forward ({report['max_new_tokens']} new tokens)")
    print(f"{'category':12} {'n':>3}  {'speedup':>8}  {'tok/fwd':>8}  identical")
    for c, s in report["categories"].items():
        print(f"{c:12} {s['n']:3}  {s['median_speedup']:7.2f}x  {s['tokens_per_forward']:8.2f}  {s['identical']}")


if __name__ == "__main__":
    raise SystemExit(main())
