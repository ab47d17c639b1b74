#!/usr/bin/env python3
"""Task accuracy against the budget from tasks.py JSON files: one group of bars per budget, one bar
per run (a LABEL=FILE argument: the library settings it was run with; files with the same label add
up) and drafter, the height the share of trials answered right among those dense answered right (all
tasks and lengths together), the count written on each bar. Optionally prints the same numbers as a
Markdown table.

Usage: plot_tasks.py LABEL=RESULTS.json... [-o PLOT.png] [--table] [--remainder none] [--lengths 1500,3000]
       (the plot needs matplotlib: pip install matplotlib; --table alone does not)"""
import argparse
import json
from collections import defaultdict
from fractions import Fraction

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("runs", nargs="+", metavar="LABEL=FILE")
ap.add_argument("-o", "--output", help="PNG path (no plot without it)")
ap.add_argument("--remainder", default="none", help="remainder whose configurations are shown [none]")
ap.add_argument("--lengths", help="only these task lengths (comma-separated) [all]")
ap.add_argument("--table", action="store_true", help="print the counts as a Markdown table")
args = ap.parse_args()


def counts(results, remainder, lengths):
    """{(budget, drafter): [right where dense is right, dense right]} over every trial of `lengths`."""
    results = [r for r in results if lengths is None or r["length"] in lengths]
    dense = {(r["task"], r["length"], r["depth"], r["seed"], r["drafter"]): r["correct"]
             for r in results if r["budget"] is None}
    out = defaultdict(lambda: [0, 0])
    for r in results:
        if r["budget"] is None or r["remainder"] != remainder:
            continue
        if dense.get((r["task"], r["length"], r["depth"], r["seed"], r["drafter"])):
            c = out[(r["config"].split()[0], r["drafter"])]
            c[0] += r["correct"]
            c[1] += 1
    return out


lengths = None if args.lengths is None else {int(x) for x in args.lengths.split(",")}
series = {}  # (label, drafter) -> {budget: (right, of)}
for item in args.runs:
    label, _, path = item.partition("=")
    with open(path) as f:
        for (budget, drafter), (right, of) in counts(json.load(f)["results"], args.remainder, lengths).items():
            r0, o0 = series.setdefault((label, drafter), {}).get(budget, (0, 0))
            series[(label, drafter)][budget] = (r0 + right, o0 + of)
budgets = sorted({b for s in series.values() for b in s}, key=Fraction, reverse=True)

if args.table:
    print("| settings | drafter | " + " | ".join(budgets) + " |")
    print("|---|---|" + "---|" * len(budgets))
    for (label, drafter), s in series.items():
        cells = [f"{s[b][0]}/{s[b][1]}" if b in s else "-" for b in budgets]
        print(f"| {label} | {drafter} | " + " | ".join(cells) + " |")

if args.output:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(series))
    for i, ((label, drafter), s) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, b in enumerate(budgets) if b in s]
        ys = [s[b][0] / s[b][1] for b in budgets if b in s]
        bars = ax.bar(xs, ys, width, label=f"{label}, {drafter} drafter")
        for bar, b in zip(bars, [b for b in budgets if b in s]):
            ax.annotate(f"{s[b][0]}/{s[b][1]}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.text(0.5, 1.01, "dense", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(budgets)), [f"budget {b} of the prompt" for b in budgets])
    ax.set_ylim(0, 1.12)
    ax.set_ylabel("right, of the trials dense gets right")
    ax.set_title(f"Task accuracy (passkey, niah, copy; remainder {args.remainder})")
    ax.legend(fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 0.92))
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print("wrote", args.output)
