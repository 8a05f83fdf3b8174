"""The transformers peer of bench.speedup: generate() in this process on the same models and numerics (target-only,
the draft alone, assisted generation and prompt lookup), at each thread count, with exactness against its own
target-only output."""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from bench.common import Prompt, first_mismatch, log, split_csv
from bench.speedup_stats import hf_summary
from specmesh.ops.launcher import PRESETS

HF_MODES = ("target", "draft", "assisted", "lookup")


def hf_phase(args: argparse.Namespace, prompts: dict[int, list[Prompt]], dtype: str) -> list[dict[str, Any]]:
    """transformers' generate() in this process on the same models (and the same int8 / int4 linears), at each
    of --hf-threads; the draft alone (for c) only at the shortest length."""
    modes = split_csv(args.hf_modes)
    if not modes:
        return []
    import torch

    from bench import compare_hf
    from specmesh.engine.build import QUANTIZERS
    from specmesh.models import load_model

    warnings.filterwarnings("ignore")
    target_ref, draft_ref = PRESETS[args.preset]
    target, draft = load_model(target_ref), load_model(draft_ref)
    if dtype in QUANTIZERS:
        QUANTIZERS[dtype][0](target.model)
        QUANTIZERS[dtype][0](draft.model)
    knobs = argparse.Namespace(assistant_tokens=0, prompt_lookup_tokens=10)
    shortest = min(prompts)
    runs = []
    for threads in [int(t) for t in split_csv(args.hf_threads)]:
        torch.set_num_threads(threads)
        compare_hf.timed_generate(target, compare_hf.encode(target, prompts[shortest][0]), 2)      # warm-up
        for length, selected in prompts.items():
            for prompt in selected:
                ids = compare_hf.encode(target, prompt)
                reference: list[int] = []
                mine = []
                for mode in ["target"] + [m for m in modes if m != "target" and (m != "draft" or length == shortest)]:
                    model = draft if mode == "draft" else target
                    kwargs = {} if mode == "draft" else compare_hf.generate_kwargs(mode, draft, knobs)
                    tokens, seconds = compare_hf.timed_generate(model, ids, length, **kwargs)
                    reference = tokens if mode == "target" else reference
                    same = mode in ("target", "draft") or tokens == reference
                    mine.append({"prompt_id": prompt.id, "category": prompt.category, "mode": mode,
                                 "threads": threads, "max_new_tokens": length, "new_tokens": len(tokens),
                                 "seconds": seconds, "matches_target": same,
                                 "mismatch_at": -1 if same else first_mismatch(reference, tokens),
                                 "token_ids": tokens})
                log(f"hf t{threads} @{length} {prompt.id:<20} tok/s: " + " | ".join(
                    f"{r['mode']} {r['new_tokens'] / r['seconds']:.2f}" for r in mine))
                runs += mine
    return runs


def hf_key(length: int, threads: int) -> str:
    return f"{length}/t{threads}"


def hf_summaries(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """hf_summary per (length, threads); the draft (run at the shortest length only) is folded into every
    length's summary for its threads."""
    out = {}
    for length in sorted({r["max_new_tokens"] for r in runs}):
        for threads in sorted({r["threads"] for r in runs}):
            mine = [r for r in runs if r["max_new_tokens"] == length and r["threads"] == threads]
            out[hf_key(length, threads)] = hf_summary(mine)
    drafts = {t: s["draft"] for k, s in out.items() if "draft" in s for t in [k.split("/t")[1]]}
    for key, s in out.items():
        s.setdefault("draft", drafts.get(key.split("/t")[1], {}))
        if not s["draft"]:
            del s["draft"]
    return out
