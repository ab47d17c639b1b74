#!/usr/bin/env python3
"""Plots a smollm2-evaluate JSON file: agreement and attention-mass recall against the budget,
one line per drafter, one column per fetch ratio (the exact top-K mass is the dotted ceiling).

Usage: plot_evaluation.py RESULTS.json [-o PLOT.png]      (pip install matplotlib)"""
import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("json")
ap.add_argument("-o", "--output", help="PNG path (default: JSON path with .png)")
args = ap.parse_args()
with open(args.json) as f:
    data = json.load(f)

ratios = sorted({r["fetch_ratio"] for r in data["runs"]}, reverse=True)
metrics = [("agreement_mean", "agreement |S_draft ∩ S_true| / |S_true|"),
           ("mass_recall_mean", "attention-mass recall")]
fig, axes = plt.subplots(len(metrics), len(ratios), figsize=(5.5 * len(ratios), 4.2 * len(metrics)), squeeze=False)
for col, ratio in enumerate(ratios):
    runs = [r for r in data["runs"] if r["fetch_ratio"] == ratio]
    by_drafter = defaultdict(list)
    for r in runs:
        by_drafter[r["drafter"]].append(r)
    for row, (key, label) in enumerate(metrics):
        ax = axes[row][col]
        for drafter, rs in by_drafter.items():
            rs.sort(key=lambda r: r["budget"])
            ax.plot([r["budget"] for r in rs], [r[key] for r in rs], marker="o", label=drafter)
        if key == "mass_recall_mean":
            best = {}
            for r in runs:
                best[r["budget"]] = r["exact_topk_mass_mean"]
            xs = sorted(best)
            ax.plot(xs, [best[x] for x in xs], "k:", label="exact top-K mass")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["budget"] for r in runs}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("budget (tokens per layer and kv head)")
        ax.set_ylabel(label)
        ax.set_title(f"fetch ratio {ratio:g}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
fig.suptitle(f"{data['model']} on {data['text']}: prompt {data['prompt_tokens']}, "
             f"decode {data['decode_tokens']}, dense ppl {data['dense']['ppl']:.3f}")
fig.tight_layout()
out = args.output or args.json.rsplit(".", 1)[0] + ".png"
fig.savefig(out, dpi=110)
print(out)
