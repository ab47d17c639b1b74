#!/usr/bin/env python3
"""Serving projection: a back-of-the-envelope MODEL of decode throughput on one GPU, dense KV in
HBM versus OasisKV (full KV in host memory, a fixed working set per (request, layer, kv head) in
HBM, refreshed over the host link). It is a model, not a measurement: it shows how the gain
depends on context length, budget, link bandwidth and traffic per step, nothing more.

Model (all assumptions are parameters; defaults in brackets)
------------------------------------------------------------
Memory per request
  KV bytes per token        = 2 (K, V) x layers x kv_heads x head_dim x dtype_bytes
  average context           = prompt + output / 2 (requests are at every point of their output)
  dense KV per request      = average context x KV bytes per token
  OasisKV per request (HBM) = working set x (1 + staging margin) + summaries, where
    working set             = layers x kv_heads x min(budget, average context) x 2 x head_dim x dtype_bytes
    staging margin          = extra slots for copies in flight [0.10 of the working set]
    summaries               = blocks of the average context x layers x kv_heads x summary bytes per
                              block [512 B: min and max per channel in bf16, as in Quest]
Batch
  KV space in HBM           = HBM x memory utilisation [0.90, vLLM's default] - weights - drafter
                              weights [0] - activation reserve [2 GB]
  dense batch               = floor(KV space / dense KV per request), at most max_batch [256]
  OasisKV batch             = floor(KV space / OasisKV per request), at most max_batch, and at most
                              host memory [256 GB: 2 TB over 8 GPUs] / dense KV per request
Step time (one token per request per step; speculative drafts are prefetch signals only, never
accepted, as in the paper's evaluation)
  dense    = max((weights + batch x dense KV) / (HBM BW x efficiency [0.80]), compute) + overhead [0]
  OasisKV  = max((weights + batch x (working set + summaries)) / (HBM BW x efficiency),
                 batch x fetched bytes per request per step / host link BW,
                 compute) + overhead
             (prefetch overlaps the step, so the link time and the HBM time do not add)
  compute  = rows x batch x (2 x parameters + 4 x layers x q_heads x head_dim x context attended)
             / (peak FLOP/s x MFU [989 TFLOP/s bf16 x 0.5]); rows = 1 dense, 2 OasisKV (the
             lookahead row)
Traffic: fetched bytes per request per step = fetched blocks per (layer, kv head) x layers x
  kv_heads x block bytes (2 x block_tokens x head_dim x dtype_bytes). By default the fetch cap is
  always full: max(1, floor(fetch_ratio x budget / block_tokens)) blocks, an upper bound. With
  --fetch-utilisation u only the share u of the cap is used. With --from-eval EVAL.json the share
  of the budget refreshed per step is read from the real-model evaluation (the JSON of
  smollm2-evaluate --json, e.g. the committed docs/evaluation/evaluation-gpl-3.json:
  runs[].blocks_fetched_per_step, or bytes_fetched_per_step / block bytes, per sequence and step,
  summed over the evaluated model's layers and kv heads) and applied to the projected model.
Throughput = batch / step time (tokens per second).

Not modelled: prefill, scheduling gaps, the drafter's compute, tail latency under misprediction,
PCIe contention between GPUs, KV growth inside a step. Usage: serving_projection.py [--help]
"""
import argparse
import json
import math
import sys

GB = 1e9

# Shapes of models the evaluation JSON may name, for --from-eval when the JSON carries no shape.
KNOWN_SHAPES = {
    "smollm2-135m": dict(layers=30, kv_heads=3, head_dim=64),
    "smollm2-360m": dict(layers=32, kv_heads=5, head_dim=64),
    "smollm2-1.7b": dict(layers=24, kv_heads=32, head_dim=64),
    "qwen3-8b": dict(layers=36, kv_heads=8, head_dim=128),
    "llama-3.1-8b": dict(layers=32, kv_heads=8, head_dim=128),
}


def kv_bytes_per_token(a):
    return 2 * a.layers * a.kv_heads * a.head_dim * a.dtype_bytes


def block_bytes(a):
    return 2 * a.block_tokens * a.head_dim * a.dtype_bytes


def cap_blocks(a):
    return max(1, math.floor(a.fetch_ratio * a.budget / a.block_tokens))


def compute_seconds(a, batch, rows, context_attended):
    params = a.weights_gb * GB / a.dtype_bytes
    flops = rows * batch * (2 * params + 4 * a.layers * a.q_heads * a.head_dim * context_attended)
    return flops / (a.peak_tflops * 1e12 * a.mfu)


def project(a, avg_context, fetched_blocks_per_head):
    """Returns a dict with dense and OasisKV batch, step time, its bound and throughput."""
    hbm_bw = a.hbm_tbps * 1e12 * a.hbm_efficiency
    link_bw = a.link_gbps * GB
    space = a.hbm_gb * GB * a.mem_util - a.weights_gb * GB - a.drafter_gb * GB - a.reserve_gb * GB
    weights = (a.weights_gb + a.drafter_gb) * GB
    dense_kv = avg_context * kv_bytes_per_token(a)

    dense_batch = min(a.max_batch, max(0, math.floor(space / dense_kv)))
    d_mem = (weights + dense_batch * dense_kv) / hbm_bw
    d_cmp = compute_seconds(a, dense_batch, 1, avg_context)
    d_step = max(d_mem, d_cmp) + a.overhead_ms / 1e3

    resident = min(a.budget, avg_context)
    ws = a.layers * a.kv_heads * resident * 2 * a.head_dim * a.dtype_bytes
    summaries = math.ceil(avg_context / a.block_tokens) * a.layers * a.kv_heads * a.summary_bytes
    per_req = ws * (1 + a.staging_margin) + summaries
    o_batch = min(a.max_batch, max(0, math.floor(space / per_req)),
                  math.floor(a.host_gb * GB / dense_kv))
    # A context within the budget is wholly resident: nothing to fetch.
    fetched = 0.0 if avg_context <= a.budget else fetched_blocks_per_head * a.layers * a.kv_heads * block_bytes(a)
    o_mem = (weights + o_batch * (ws + summaries)) / hbm_bw
    o_link = o_batch * fetched / link_bw
    o_cmp = compute_seconds(a, o_batch, 2, resident)
    o_step = max(o_mem, o_link, o_cmp) + a.overhead_ms / 1e3
    bound = {o_mem: "HBM", o_link: "link", o_cmp: "compute"}[max(o_mem, o_link, o_cmp)]
    d_tput = dense_batch / d_step if d_step > 0 else 0.0
    o_tput = o_batch / o_step if o_step > 0 else 0.0
    return dict(context=avg_context, dense_batch=dense_batch, dense_step_ms=d_step * 1e3,
                dense_bound="HBM" if d_mem >= d_cmp else "compute", dense_tps=d_tput,
                oasis_batch=o_batch, oasis_step_ms=o_step * 1e3, oasis_bound=bound, oasis_tps=o_tput,
                fetched_mb=fetched / 1e6, link_ms=o_link * 1e3, hbm_ms=o_mem * 1e3,
                ratio=o_tput / d_tput if d_tput > 0 else float("inf"))


def eval_refresh_shares(path, a):
    """Per run of the evaluation JSON: (label, share of the budget fetched per (layer, kv head) and
    step). The JSON (written by experiments/smollm2's smollm2-evaluate --json; a committed one:
    docs/evaluation/evaluation-gpl-3.json) gives per-sequence traffic per step summed
    over the evaluated model; its shape comes from the JSON (num_layers/num_kv_heads/head_dim at
    the top level or under "shape"/"model_shape"), else from --eval-shape, else from the model name."""
    with open(path) as f:
        data = json.load(f)
    shape = {}
    for src in (data, data.get("shape", {}) or {}, data.get("model_shape", {}) or {}):
        for key, name in (("num_layers", "layers"), ("num_hidden_layers", "layers"),
                          ("num_kv_heads", "kv_heads"), ("num_key_value_heads", "kv_heads"),
                          ("head_dim", "head_dim"), ("dtype_bytes", "dtype_bytes")):
            if key in src:
                shape[name] = src[key]
    if a.eval_shape:
        layers, kv_heads, head_dim = (int(x) for x in a.eval_shape.split(","))
        shape.update(layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    if not {"layers", "kv_heads", "head_dim"} <= shape.keys():
        name = str(data.get("model", "")).lower().split("/")[-1]
        for known, s in KNOWN_SHAPES.items():
            if known in name:
                shape = {**s, **shape}
                break
    if not {"layers", "kv_heads", "head_dim"} <= shape.keys():
        sys.exit(f"serving_projection: {path} names model '{data.get('model')}' without its shape; "
                 "pass --eval-shape LAYERS,KV_HEADS,HEAD_DIM")
    block_tokens = data.get("block_tokens", a.block_tokens)
    eval_block_bytes = 2 * block_tokens * shape["head_dim"] * shape.get("dtype_bytes", a.eval_dtype_bytes)
    out = []
    for run in data.get("runs", []):
        if "blocks_fetched_per_step" in run:
            blocks = run["blocks_fetched_per_step"]
        elif "bytes_fetched_per_step" in run:
            blocks = run["bytes_fetched_per_step"] / eval_block_bytes
        else:
            continue
        budget_blocks = run.get("budget", a.budget) / block_tokens
        share = blocks / (shape["layers"] * shape["kv_heads"]) / budget_blocks
        label = f"{run.get('drafter', '?')}, budget {run.get('budget', '?')}, fetch ratio {run.get('fetch_ratio', '?')}"
        out.append((label, share, run.get("budget", a.budget)))
    if not out:
        sys.exit(f"serving_projection: {path} has no runs with bytes_fetched_per_step")
    return out, data.get("model", "?")


def table(rows):
    head = ("| avg context | dense batch | dense step | dense tok/s | OasisKV batch | OasisKV step (bound) "
            "| fetched / req / step | OasisKV tok/s | OasisKV / dense |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']:,} | {r['dense_batch']} | {r['dense_step_ms']:.1f} ms | {r['dense_tps']:,.0f} "
                     f"| {r['oasis_batch']} | {r['oasis_step_ms']:.1f} ms ({r['oasis_bound']}) | {r['fetched_mb']:.2f} MB "
                     f"| {r['oasis_tps']:,.0f} | {r['ratio']:.2f}x |")
    return "\n".join(lines)


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Defaults: the paper's setting (Qwen3-8B, H100 80 GB, ~64 GB/s PCIe, "
                                       "AIME-like prompt 1K / output 16K).")
    g = p.add_argument_group("GPU and host")
    g.add_argument("--hbm-gb", type=float, default=80.0)
    g.add_argument("--hbm-tbps", type=float, default=3.35, help="HBM bandwidth, TB/s (H100 SXM)")
    g.add_argument("--hbm-efficiency", type=float, default=0.8, help="share of HBM bandwidth decode reaches")
    g.add_argument("--link-gbps", type=float, default=64.0, help="host link bandwidth, GB/s (the paper's figure)")
    g.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s")
    g.add_argument("--mfu", type=float, default=0.5)
    g.add_argument("--mem-util", type=float, default=0.9)
    g.add_argument("--reserve-gb", type=float, default=2.0, help="activations, CUDA graphs, workspace")
    g.add_argument("--host-gb", type=float, default=256.0, help="host memory per GPU for full KV")
    g.add_argument("--overhead-ms", type=float, default=0.0, help="fixed per-step overhead")
    g.add_argument("--max-batch", type=int, default=256)
    m = p.add_argument_group("model (default Qwen3-8B)")
    m.add_argument("--layers", type=int, default=36)
    m.add_argument("--q-heads", type=int, default=32)
    m.add_argument("--kv-heads", type=int, default=8)
    m.add_argument("--head-dim", type=int, default=128)
    m.add_argument("--dtype-bytes", type=int, default=2)
    m.add_argument("--weights-gb", type=float, default=16.4)
    m.add_argument("--drafter-gb", type=float, default=0.0)
    w = p.add_argument_group("workload and OasisKV")
    w.add_argument("--prompt", type=int, default=1024)
    w.add_argument("--output", type=int, default=16384)
    w.add_argument("--budget", type=int, default=2048, help="tokens per (request, layer, kv head)")
    w.add_argument("--block-tokens", type=int, default=16)
    w.add_argument("--fetch-ratio", type=float, default=0.05)
    w.add_argument("--fetch-utilisation", type=float, default=1.0, help="share of the fetch cap used per step")
    w.add_argument("--fetched-mb", type=float, help="fetched MB per request per step (overrides the cap)")
    w.add_argument("--staging-margin", type=float, default=0.10)
    w.add_argument("--summary-bytes", type=int, default=512, help="summary bytes per block per kv head per layer")
    w.add_argument("--from-eval", metavar="EVAL_JSON", help="traffic per step from the real-model evaluation")
    w.add_argument("--eval-shape", metavar="L,KVH,D", help="the evaluated model's shape if the JSON lacks it")
    w.add_argument("--eval-dtype-bytes", type=int, default=2)
    w.add_argument("--paper-batch", type=int, default=36,
                   help="batch cap of the second paper-setting row: the paper's 2,083 tok/s at its quoted ~17 ms "
                        "step imply ~35 concurrent requests (our inference, not a reported figure)")
    w.add_argument("--sweep", default="2048,4096,8192,16384,32768,65536,131072",
                   help="average contexts of the sweep")
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    avg = a.prompt + a.output // 2
    if a.fetched_mb is not None:
        per_head = a.fetched_mb * 1e6 / (a.layers * a.kv_heads * block_bytes(a))
        traffic = f"{a.fetched_mb} MB per request per step (given)"
    else:
        per_head = cap_blocks(a) * a.fetch_utilisation
        traffic = (f"fetch cap {cap_blocks(a)} blocks per (layer, kv head) per step "
                   f"(fetch ratio {a.fetch_ratio}), {a.fetch_utilisation:.0%} used")
    print("OasisKV serving projection -- a MODEL, not a measurement (assumptions: tools/serving_projection.py --help "
          "and its docstring)")
    print(f"GPU: {a.hbm_gb:g} GB HBM at {a.hbm_tbps:g} TB/s x {a.hbm_efficiency:g}, host link {a.link_gbps:g} GB/s; "
          f"model: {a.layers} layers, {a.kv_heads} kv heads, head dim {a.head_dim}, {a.dtype_bytes} B, "
          f"{a.weights_gb:g} GB weights ({kv_bytes_per_token(a) / 1024:.0f} KiB KV per token)")
    print(f"workload: prompt {a.prompt:,}, output {a.output:,} -> average context {avg:,}; budget {a.budget:,} "
          f"tokens per kv head; traffic: {traffic}")
    print()
    r = project(a, avg, per_head)
    capped = project(argparse.Namespace(**{**vars(a), "max_batch": min(a.max_batch, a.paper_batch)}), avg, per_head)
    print("Paper setting (Qwen3-8B, H100 80 GB, ~64 GB/s PCIe, AIME-like long reasoning); second row: batch "
          f"capped at {a.paper_batch} concurrent requests (--paper-batch)")
    print(table([r, capped]))
    print(f"projected OasisKV / dense: {r['ratio']:.2f}x (memory-limited batch), {capped['ratio']:.2f}x (batch <= "
          f"{a.paper_batch}); paper, measured on AIME24: 1.69x = 2,083 / 1,235 tok/s")
    print()
    if a.from_eval:
        runs, model = eval_refresh_shares(a.from_eval, a)
        print(f"Traffic from the evaluation {a.from_eval} (model {model}), applied to the projected model:")
        print("| run | budget share fetched per step | fetched / req / step | OasisKV tok/s | OasisKV / dense |")
        print("|---|---|---|---|---|")
        for label, share, budget in runs:
            b = argparse.Namespace(**{**vars(a), "budget": budget})
            blocks = share * budget / a.block_tokens
            e = project(b, avg, blocks)
            print(f"| {label} | {share:.3%} | {e['fetched_mb']:.2f} MB | {e['oasis_tps']:,.0f} | {e['ratio']:.2f}x |")
        print()
    print("Sweep over average context (same GPU, model and traffic):")
    print(table([project(a, int(c), per_head) for c in a.sweep.split(",")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
