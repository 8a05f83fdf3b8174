"""Text table and PNG of a bench/speedup.py report (the dict written to JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import log, pyplot

SPEC_ARMS = ("model", "tiers", "adaptive", "no-prefetch", "head-32k")
HF_SPEC = ("assisted", "lookup")


def rtt_points(summary: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Per swept arm: (rtt ms, decode speedup median) over the sweep prompts ("ARM@rttN" rows)."""
    points: dict[str, list[tuple[float, float]]] = {}
    for key, rows in summary.items():
        arm, sep, rtt = key.partition("@rtt")
        if sep and rows.get("overall", {}).get("n"):
            points.setdefault(arm, []).append((float(rtt), rows["overall"]["speedup"]["decode_median"]))
    return {arm: sorted(p) for arm, p in points.items()}


def print_report(report: dict[str, Any]) -> None:
    summary, hf = report["summary"], report["hf"]
    target = summary["target"]
    head = (f"{'arm':<13}{'category':<11}{'n':>3}{'tok/s':>8}{'decode x':>10}{'wall x':>8}{'agg x':>7}"
            f"{'accept':>8}{'a/pos':>7}{'tok/rnd':>8}")
    print("\nstack arms: speedup over stack target-only (decode = tokens after the first; medians over prompts)\n"
          + head + "\n" + "-" * len(head))
    for cat, row in target.items():
        print(f"{'target':<13}{cat:<11}{row.get('n', 0):>3}{row.get('aggregate_tok_s', 0):>8.2f}")
    for arm in SPEC_ARMS:
        for cat, row in summary.get(arm, {}).items():
            if not row.get("n"):
                continue
            s = row["speedup"]
            print(f"{arm:<13}{cat:<11}{row['n']:>3}{row['aggregate_tok_s']:>8.2f}{s['decode_median']:>9.2f}x"
                  f"{s['wall_median']:>7.2f}x{s['aggregate']:>6.2f}x{row['acceptance_rate']:>8.2f}"
                  f"{row['pooled_acceptance']:>7.2f}{row['mean_tokens_per_round']:>8.2f}")
    if hf:
        print("\nin-process transformers: tok/s (speedup over transformers target-only) per category")
        cats = list(next(iter(hf.values())))
        print(f"{'mode':<10}" + "".join(f"{c:>18}" for c in cats))
        for mode, rows in hf.items():
            print(f"{mode:<10}" + "".join(
                f"{rows[c]['tok_s']:>10.2f} ({rows[c]['speedup']:.2f}x)" if c in rows else f"{'-':>18}" for c in cats))
        if "assisted" in hf and "model" in summary:
            ratio = summary["model"]["overall"]["aggregate_tok_s"] / hf["assisted"]["overall"]["tok_s"]
            print(f"\nspecmesh model arm vs transformers assisted generation (aggregate tok/s): {ratio:.2f}x")
    if report.get("analytic"):
        a = report["analytic"]
        print(f"analytic bound (1-a^(g+1))/((1-a)(g c+1)) with a={a['a']:.2f} g={a['g']} c={a['c']:.2f}: "
              f"{a['bound']:.2f}x; measured (model, decode median) {a['measured_decode_median']:.2f}x = "
              f"{a['fraction_of_bound']:.2f} of the bound")
    for arm, points in rtt_points(summary).items():
        zero = dict(points).get(0.0, 0.0)
        print(f"draft-link RTT sweep, {arm} (decode speedup median): " + ", ".join(
            f"{rtt:g} ms {x:.2f}x" + (f" ({x / zero:.0%} of 0 ms)" if zero and rtt else "") for rtt, x in points))


def plot(report: dict[str, Any], path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    summary, hf = report["summary"], report["hf"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8))
    series = {arm: summary[arm] for arm in SPEC_ARMS if arm in summary}
    series |= {f"hf-{m}": hf[m] for m in HF_SPEC if m in hf}
    cats = [c for c in summary["target"] if c != "overall"] + ["overall"]
    width = 0.8 / max(1, len(series))
    for j, (name, rows) in enumerate(series.items()):
        values = [(rows[c]["speedup"]["decode_median"] if not name.startswith("hf-") else rows[c]["speedup"])
                  if c in rows and (name.startswith("hf-") or rows[c].get("n")) else 0.0 for c in cats]
        ax1.bar([i - 0.4 + width * (j + 0.5) for i in range(len(cats))], values, width, label=name)
    ax1.axhline(1.0, color="black", linewidth=0.8)
    ax1.set(xticks=list(range(len(cats))), xticklabels=cats, ylabel="speedup over target-only",
            title="speedup per category (stack: decode median)")
    ax1.legend(fontsize=8)
    for arm in SPEC_ARMS:
        if arm in summary:
            pos = [p for p in summary[arm]["overall"]["position_acceptance"] if p["reached"] >= 5]
            ax2.plot([p["position"] for p in pos], [p["rate"] for p in pos], marker="o", label=arm)
    ax2.set(ylim=(0, 1.02), xlabel="draft position i", ylabel="P(accept i | 1..i-1 accepted)",
            title="acceptance per draft position")
    ax2.legend(fontsize=8)
    sweeps = rtt_points(summary)
    for arm, points in sweeps.items():
        line = ax3.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=arm)[0]
        zero = dict(points).get(0.0)
        if zero:
            ax3.axhline(0.8 * zero, color=line.get_color(), linestyle="--", linewidth=0.8, label=f"80% of {arm} at 0")
    ax3.axhline(1.0, color="black", linewidth=0.8)
    ax3.set(xlabel="draft-link RTT (ms)", ylabel="decode speedup (median)", title="speedup vs RTT")
    if sweeps:
        ax3.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")
