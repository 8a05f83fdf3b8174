"""In-process baselines on the same models: transformers' own greedy decoding, assisted generation
(`assistant_model=draft`) and prompt lookup (`prompt_lookup_num_tokens=`), on workload prompts with the
target's chat template. Measures tokens/s and checks that the assisted/lookup outputs equal target-only greedy.

    .venv/bin/python -m bench.compare_hf --preset tiny --limit 4 --max-new-tokens 32
    .venv/bin/python -m bench.compare_hf --preset qwen --limit 3 --max-new-tokens 48 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import asdict, dataclass
from itertools import zip_longest
from typing import Any

import torch

from bench.common import DEFAULT_WORKLOAD, RESULTS_DIR, Prompt, load_workload
from specmesh.models import load_model
from specmesh.models.loader import LoadedModel

PAIRS = {"tiny": ("tiny-target", "tiny-draft"), "qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")}
MODES = ("target", "assisted", "lookup")


@dataclass
class Run:
    prompt_id: str
    category: str
    mode: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    matches_target: bool | None   # None for the target-only run itself

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PAIRS), default="tiny")
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--limit", type=int, default=0, help="number of prompts, taken round-robin over categories")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10)
    p.add_argument("--assistant-tokens", type=int, default=0,
                   help="num_assistant_tokens for assisted generation (0 = the draft's generation_config)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def select_prompts(path: str, limit: int) -> list[Prompt]:
    """Round-robin over categories in file order, so a small limit still covers several categories."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in load_workload(path):
        by_cat.setdefault(p.category, []).append(p)
    ordered = [p for group in zip_longest(*by_cat.values()) for p in group if p is not None]
    return ordered[:limit] if limit else ordered


def encode(target: LoadedModel, prompt: Prompt) -> torch.Tensor:
    tok = target.tokenizer
    if getattr(tok, "chat_template", None):
        msgs = [{"role": role, "content": text} for role, text in prompt.messages]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    else:
        ids = tok(prompt.prompt)["input_ids"]
    return torch.tensor([ids])


def generate_kwargs(mode: str, draft: LoadedModel, args: argparse.Namespace) -> dict[str, Any]:
    if mode == "assisted":
        kwargs: dict[str, Any] = {"assistant_model": draft.model}
        if args.assistant_tokens:
            kwargs["num_assistant_tokens"] = args.assistant_tokens
        return kwargs
    if mode == "lookup":
        return {"prompt_lookup_num_tokens": args.prompt_lookup_tokens}
    return {}


@torch.inference_mode()
def timed_generate(target: LoadedModel, ids: torch.Tensor, max_new: int, **kwargs: Any) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = target.model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
        eos_token_id=list(target.eos_token_ids), pad_token_id=target.eos_token_ids[0], **kwargs)
    seconds = time.perf_counter() - t0
    return out[0, ids.shape[1]:].tolist(), seconds


def assistant_settings(draft: LoadedModel, override: int) -> dict[str, Any]:
    """The assisted-generation knobs in effect: the draft's generation_config over transformers' defaults."""
    cfg = draft.model.generation_config
    settings = {k: v for k, v in cfg._get_default_generation_params().items() if k.startswith(("assist", "num_ass"))}
    settings |= {k: getattr(cfg, k) for k in settings if getattr(cfg, k, None) is not None}
    if override:
        settings["num_assistant_tokens"] = override
    return settings


def run_prompt(target: LoadedModel, draft: LoadedModel, prompt: Prompt, args: argparse.Namespace,
               modes: list[str]) -> list[Run]:
    ids = encode(target, prompt)
    runs: list[Run] = []
    reference: list[int] | None = None
    for mode in modes:
        tokens, seconds = timed_generate(target, ids, args.max_new_tokens, **generate_kwargs(mode, draft, args))
        if mode == "target":
            reference = tokens
        same = None if mode == "target" or reference is None else tokens == reference
        runs.append(Run(prompt.id, prompt.category, mode, ids.shape[1], len(tokens), seconds, same))
        print(f"  {prompt.id:14s} {mode:9s} {len(tokens):4d} tok {seconds:7.2f} s {runs[-1].tok_s:7.2f} tok/s"
              + ("" if same is None else f"  same as target: {same}"), flush=True)
    return runs


def summarize(runs: list[Run]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(r.mode for r in runs):
        mine = [r for r in runs if r.mode == mode]
        tokens, seconds = sum(r.new_tokens for r in mine), sum(r.seconds for r in mine)
        checked = [r.matches_target for r in mine if r.matches_target is not None]
        out[mode] = {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 3),
                     "identical_to_target": f"{sum(checked)}/{len(checked)}" if checked else None}
        per_cat: dict[str, list[Run]] = {}
        for r in mine:
            per_cat.setdefault(r.category, []).append(r)
        out[mode]["per_category_tok_s"] = {
            c: round(sum(r.new_tokens for r in rs) / sum(r.seconds for r in rs), 3) for c, rs in per_cat.items()}
    if "target" in out:
        for mode in out:
            out[mode]["speedup_vs_target"] = round(out[mode]["tok_s"] / out["target"]["tok_s"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    target_ref, draft_ref = PAIRS[args.preset]
    t0 = time.perf_counter()
    target, draft = load_model(target_ref), load_model(draft_ref)
    load_s = time.perf_counter() - t0
    prompts = select_prompts(args.workload, args.limit)
    print(f"{target_ref} + {draft_ref}: loaded in {load_s:.1f} s; {len(prompts)} prompts, modes {modes}", flush=True)
    timed_generate(target, encode(target, prompts[0]), 2)   # warm-up (first-call allocations)
    runs = [r for p in prompts for r in run_prompt(target, draft, p, args, modes)]
    report = {"preset": args.preset, "target": target_ref, "draft": draft_ref, "threads": args.threads,
              "max_new_tokens": args.max_new_tokens, "prompt_lookup_tokens": args.prompt_lookup_tokens,
              "assistant_settings": assistant_settings(draft, args.assistant_tokens),
              "torch": torch.__version__, "load_s": round(load_s, 1), "summary": summarize(runs),
              "runs": [asdict(r) | {"tok_s": round(r.tok_s, 3)} for r in runs]}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = args.out or str(RESULTS_DIR / f"compare-hf-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
