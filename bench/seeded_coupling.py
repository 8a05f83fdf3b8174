"""What seeded reproducibility costs in acceptance: per-token match rate of the seeded Gumbel coupling
(specmesh/spec/seeded.py: a draft token is accepted iff it equals the target's own seeded draw) against rejection
sampling's acceptance 1 - TV(p, q), on synthetic target / draft distributions at several distances.

    python -m bench.seeded_coupling [--vocab 2000] [--positions 60] [--seeds 150]

No model: p = softmax(3 z), q = softmax(3 z + noise * z'), z, z' standard normal, for each logit noise level.
"""

from __future__ import annotations

import argparse

import torch

from specmesh.spec.seeded import seeded_token

NOISE_LEVELS = (0.3, 0.7, 1.2)


def one_level(noise: float, vocab: int, positions: int, seeds: int, gen: torch.Generator) -> dict[str, float]:
    tvs, matches = [], []
    for position in range(positions):
        z = torch.randn(vocab, generator=gen, dtype=torch.float64) * 3
        p = torch.softmax(z, -1)
        q = torch.softmax(z + noise * torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
        tvs.append(0.5 * float((p - q).abs().sum()))
        matches.append(sum(seeded_token(p, s, position) == seeded_token(q, s, position) for s in range(seeds)) / seeds)
    tv = sum(tvs) / positions
    return {"noise": noise, "tv": tv, "rejection": 1 - tv, "seeded": sum(matches) / positions,
            "bound": (1 - tv) / (1 + tv)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=2000, help="vocabulary size (default %(default)s)")
    parser.add_argument("--positions", type=int, default=60, help="distributions per level (default %(default)s)")
    parser.add_argument("--seeds", type=int, default=150, help="seeds per distribution (default %(default)s)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print("logit noise | mean TV(p, q) | rejection sampling 1 - TV | seeded match | (1 - TV) / (1 + TV)")
    for noise in NOISE_LEVELS:
        r = one_level(noise, args.vocab, args.positions, args.seeds, gen)
        print(f"{r['noise']:11.1f} | {r['tv']:13.3f} | {r['rejection']:25.3f} | {r['seeded']:12.3f} | {r['bound']:.3f}")


if __name__ == "__main__":
    main()
