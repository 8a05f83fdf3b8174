"""What top-k / top-p cost a sampled row of the real vocabulary: the candidates' ranking (specmesh/spec/sampling.py)
against a sort of the whole row (the rule it replaced), on one thread, for peaked and flat rows.

    python -m bench.sampling_filters                   # ~20 s; writes bench/results/sampling-filters-<time>.json

Both keep the same tokens (tests/test_sampling.py); each figure is the median of `--repeats` calls of
`logits_to_probs` (temperature, the filters, renormalization) on one [1, V] row, V = 151,936 (Qwen2.5's).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from unittest import mock

import torch

from bench.common import median_s, result_paths, run_metadata, write_json
from specmesh.spec import sampling
from specmesh.spec.sampling import SamplingParams, logits_to_probs

NUM_VOCAB = 151_936
SETTINGS = {"top_p 0.9, T 0.7": SamplingParams(temperature=0.7, top_p=0.9),
            "top_k 40": SamplingParams(temperature=1.0, top_k=40),
            "top_k 40, top_p 0.95": SamplingParams(temperature=1.0, top_k=40, top_p=0.95),
            "temperature 1 only": SamplingParams(temperature=1.0)}
ROWS = {"peaked (logits sd 3)": 3.0, "flat (logits sd 0.3)": 0.3}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--name", default="sampling-filters")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'row':<22}{'setting':<24}{'candidates ms':>15}{'full sort ms':>14}{'kept':>8}")
    for row_name, scale in ROWS.items():
        logits = torch.randn(1, NUM_VOCAB, generator=generator) * scale
        for name, params in SETTINGS.items():
            kept = int((logits_to_probs(logits, params) > 0).sum())
            call = functools.partial(logits_to_probs, logits, params)
            fast = 1000 * median_s(call, args.repeats, warmups=3)
            with mock.patch.object(sampling, "_top_ranked", lambda *_: None):     # every row sorted whole
                full = 1000 * median_s(call, args.repeats, warmups=3)
            rows.append({"row": row_name, "setting": name, "candidates_ms": fast, "full_sort_ms": full, "kept": kept})
            print(f"{row_name:<22}{name:<24}{fast:>15.2f}{full:>14.2f}{kept:>8}")
    json_path, _ = result_paths(args.name)
    write_json(json_path, {"meta": run_metadata(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
