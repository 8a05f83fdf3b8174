"""Text table and PNG of a bench/speedup.py report (the dict written to JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import log, pyplot
from bench.speedup_arms import SPEC_ARMS, parse_run_key, run_key

HF_SPEC = ("assisted", "lookup")


def rtt_points(summary: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Per swept arm: (rtt ms, decode speedup median) over the sweep prompts ("ARM@rttN" rows)."""
    points: dict[str, list[tuple[float, float]]] = {}
    for key, rows in summary.items():
        arm, sep, rtt = key.partition("@rtt")
        if sep and rows.get("overall", {}).get("n"):
            points.setdefault(arm, []).append((float(rtt), rows["overall"]["speedup"]["decode_median"]))
    return {arm: sorted(p) for arm, p in points.items()}


def _arm_table(key: str, arms: dict[str, Any], na: dict[str, list[str]]) -> None:
    head = (f"{'arm':<12}{'category':<11}{'n':>3}{'tok/s':>8}{'dec tok/s':>10}{'decode x':>9}{'wall x':>8}"
            f"{'accept':>8}{'tok/rnd':>8}{'drft/rnd':>9}")
    print(f"\n[{key}] stack arms: speedup over this layout's target-only (decode = tokens after the first; medians "
          f"over prompts)\n{head}\n" + "-" * len(head))
    for cat, row in arms["target"].items():
        print(f"{'target':<12}{cat:<11}{row.get('n', 0):>3}{row.get('aggregate_tok_s', 0):>8.2f}"
              f"{row.get('median_decode_tok_s', 0):>10.2f}")
    for arm, rows in arms.items():
        if arm == "target":
            continue
        for cat, row in rows.items():
            if not row.get("n"):
                continue
            s = row["speedup"]
            per_round = row["num_drafted"] / row["num_rounds"] if row.get("num_rounds") else 0.0
            print(f"{arm:<12}{cat:<11}{row['n']:>3}{row['aggregate_tok_s']:>8.2f}{row['median_decode_tok_s']:>10.2f}"
                  f"{s['decode_median']:>8.2f}x{s['wall_median']:>7.2f}x{row['acceptance_rate']:>8.2f}"
                  f"{row['mean_tokens_per_round']:>8.2f}{per_round:>9.2f}")
    for arm, missing in na.items():
        print(f"{arm:<12}n/a: the gateway has no {', '.join(missing)} yet (not run)")


def peer_rows(report: dict[str, Any], length: int) -> list[tuple[str, float, str]]:
    """(label, decode tok/s, note) of every way to decode at one length: stack arms per layout and the peers."""
    rows = []
    for key, arms in report["summary"].items():
        layout, n = parse_run_key(key)
        if n != length:
            continue
        for arm, by_cat in arms.items():
            if "@" not in arm and by_cat.get("overall", {}).get("n"):
                rows.append((f"specmesh {arm} ({layout})", by_cat["overall"]["median_decode_tok_s"], "median"))
    for key, modes in report["hf"].items():
        n, threads = key.split("/t")
        if int(n) == length:
            for mode, by_cat in modes.items():
                ident = f"identical {by_cat['overall']['identical_to_target']}/{by_cat['overall']['n']}"
                rows.append((f"hf {mode} t{threads}", by_cat["overall"]["tok_s"], ident if mode in HF_SPEC else ""))
    for threads, configs in report.get("llamacpp", {}).get("summary", {}).get(str(length), {}).items():
        for config, by_cat in configs.items():
            o = by_cat["overall"]
            note = f"identical {o['identical_to_target']}/{o['n']}, acceptance {o['acceptance']:.2f}" \
                if config == "spec" else ""
            rows.append((f"llama.cpp {config} t{threads}", o["decode_tok_s"], note))
    return rows


def print_peers(report: dict[str, Any], lengths: list[int]) -> None:
    for length in lengths:
        rows = peer_rows(report, length)
        if not rows:
            continue
        ref = {label: tok_s for label, tok_s, _ in rows}
        bases = [b for b in ("specmesh target (b)", "llama.cpp target t2", "hf target t2") if ref.get(b)]
        print(f"\n@{length} new tokens: decode tok/s (specmesh: median over prompts; peers: pooled), ratios")
        print(f"{'':<28}{'tok/s':>8}" + "".join(f"{'/ ' + b:>26}" for b in bases))
        for label, tok_s, note in rows:
            print(f"{label:<28}{tok_s:>8.2f}" + "".join(f"{tok_s / ref[b]:>25.2f}x" for b in bases)
                  + (f"  {note}" if note else ""))
        llama = report.get("llamacpp", {}).get("summary", {}).get(str(length), {})
        for threads, configs in llama.items():
            if "spec" in configs:
                cats = ", ".join(f"{c} {r['speedup']:.2f}x" for c, r in configs["spec"].items())
                print(f"llama.cpp t{threads} draft speedup over its own target-only: {cats}")


def print_report(report: dict[str, Any]) -> None:
    summary = report["summary"]
    for key, arms in summary.items():
        _arm_table(key, arms, report.get("not_run", {}).get(parse_run_key(key)[0], {}))
    lengths = sorted({parse_run_key(k)[1] for k in summary})
    print_peers(report, lengths)
    if "skipped" in report.get("llamacpp", {}):
        print(f"llama.cpp peer not run: {report['llamacpp']['skipped']}")
    for failure in report.get("llamacpp", {}).get("failed", []):
        print(f"llama.cpp peer failed: {failure}")
    print("\ndraft/target cost ratio c per layout (in-process draft vs the layout's target-only arm): "
          + ", ".join(f"{k} {v:.2f}" for k, v in report.get("cost_ratio", {}).items()))
    for key, a in report.get("analytic", {}).items():
        if a:
            print(f"[{key}] analytic bound (1-a^(g+1))/((1-a)(g c+1)) for {a['arm']}, a={a['a']:.2f} g={a['g']} "
                  f"c={a['c']:.2f}: {a['bound']:.2f}x; measured {a['measured_decode_median']:.2f}x = "
                  f"{a['fraction_of_bound']:.2f} of the bound")
    for key, arms in summary.items():
        for arm, points in rtt_points(arms).items():
            print(f"[{key}] draft-link RTT sweep, {arm} (decode speedup median): " + ", ".join(
                f"{rtt:g} ms {x:.2f}x" for rtt, x in points))


def plot(report: dict[str, Any], path: Path, title: str) -> None:
    """Per length, one row: speedup per category per arm for each layout side by side, then tok/s vs peers."""
    plt = pyplot()
    if plt is None:
        return
    summary = report["summary"]
    lengths = sorted({parse_run_key(k)[1] for k in summary})
    layouts = sorted({parse_run_key(k)[0] for k in summary})
    cols = len(layouts) + 1
    fig, axes = plt.subplots(len(lengths), cols, figsize=(6 * cols, 4.6 * len(lengths)), squeeze=False)
    for i, length in enumerate(lengths):
        for j, layout in enumerate(layouts):
            na = sorted(report.get("not_run", {}).get(layout, {}))
            _speedup_axis(axes[i][j], summary.get(run_key(layout, length), {}), f"layout {layout}, {length} tokens"
                          + (f" (n/a: {', '.join(na)})" if na else ""))
        rows = peer_rows(report, length)
        ax = axes[i][-1]
        ax.barh([r[0] for r in rows], [r[1] for r in rows],
                color=["tab:blue" if r[0].startswith("specmesh") else "tab:gray" for r in rows])
        ax.set(xlabel="decode tok/s", title=f"tok/s vs peers, {length} tokens")
        ax.tick_params(axis="y", labelsize=7)
        ax.invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    log(f"wrote {path}")


def _speedup_axis(ax: Any, arms: dict[str, Any], title: str) -> None:
    series = {a: arms[a] for a in arms if a in SPEC_ARMS}
    cats = [c for c in arms.get("target", {}) if c != "overall"] + ["overall"]
    width = 0.8 / max(1, len(series))
    for j, (name, rows) in enumerate(series.items()):
        values = [rows[c]["speedup"]["decode_median"] if rows.get(c, {}).get("n") else 0.0 for c in cats]
        ax.bar([i - 0.4 + width * (j + 0.5) for i in range(len(cats))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set(xticks=list(range(len(cats))), ylabel="decode speedup over target-only", title=title)
    ax.set_xticklabels(cats, fontsize=8, rotation=20)
    if series:
        ax.legend(fontsize=7)
