#!/usr/bin/env python3
"""Perplexity ratio (sparse / dense) against the budget from smollm2-evaluate JSON files: one panel
per file (text and prompt length), one line per variant (remainder estimate, scorer, group
reduction, budget profile: whichever fields the runs carry). Optionally prints the same runs as a Markdown table.

Usage: plot_budget.py RESULTS.json... [-o PLOT.png] [--drafter oracle] [--table]
       (the plot needs matplotlib: pip install matplotlib; --table alone does not)"""
import argparse
import json
import os
from collections import defaultdict

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("json", nargs="+")
ap.add_argument("-o", "--output", help="PNG path (no plot without it)")
ap.add_argument("--drafter", default="oracle", help="drafter whose runs are plotted [oracle]")
ap.add_argument("--table", action="store_true", help="print every run as a Markdown table")
args = ap.parse_args()


def variant(run):
    """What distinguishes runs of one budget and drafter: the fields the evaluator adds per variant."""
    parts = [run.get("remainder") or "none"]
    if run.get("scorer") not in (None, "quest"):
        parts.append("scorer " + run["scorer"])
    if run.get("reduction") not in (None, "sum"):
        parts.append("reduction " + run["reduction"])
    if run.get("profile") not in (None, "uniform"):
        parts.append("profile " + os.path.basename(str(run["profile"])))
    return ", ".join(parts)


files = []
for path in args.json:
    with open(path) as f:
        data = json.load(f)
    label = f"{os.path.basename(data['text'])}, prompt {data['prompt_tokens']}"
    files.append((label, data))

if args.table:
    print("| text, prompt | budget | drafter | variant | ppl / dense | KL | top-1 agr. | attn err | blocks / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, data in files:
        dense = data["dense"]["ppl"]
        for r in sorted(data["runs"], key=lambda r: (r["budget"], r["drafter"], variant(r))):
            print(f"| {label} | {r['budget']} | {r['drafter']} | {variant(r)} | {r['ppl'] / dense:.4f} | "
                  f"{r['kl_mean']:.4f} | {r['top1_agreement']:.3f} | {r['attn_rel_err_mean']:.4f} | "
                  f"{r['blocks_fetched_per_step']:.0f} |")

if args.output:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(files), figsize=(5.2 * len(files), 4.2), squeeze=False)
    for ax, (label, data) in zip(axes[0], files):
        dense = data["dense"]["ppl"]
        lines = defaultdict(list)
        for r in data["runs"]:
            if r["drafter"] == args.drafter:
                lines[variant(r)].append((r["budget"], r["ppl"] / dense))
        for name, points in sorted(lines.items()):
            points.sort()
            ax.plot([b for b, _ in points], [p for _, p in points], marker="o", label=name)
        ax.axhline(1.01, color="grey", linestyle=":", linewidth=1, label="goal: within 1% of dense")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens per kv head)")
        ax.set_ylabel("perplexity / dense")
        ax.set_title(f"{label}, {args.drafter} drafter")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")
