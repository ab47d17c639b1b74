#!/usr/bin/env python3
"""The Python call overhead: append + prefetch + acquire + release of one layer for batch 8 through
the oasiskv module, against the same calls in C++ (BM_CallOverhead in bench/bench_call_overhead.cpp:
same shape, Llama-3-8B-like per layer, 32 query / 8 kv heads, head dim 128, float16 rows, float32
queries, 2,048-token budget; same context and iteration count). Prints one row per context with
both times per step and the ratio Python / C++.

Usage: bench_call_overhead.py [--cpp-bench build/bench/oasiskv_bench] [--repetitions 5]
Without --cpp-bench (or when the binary is absent) only the Python side is printed.
Measure on an idle machine: both sides run one after the other, each the median of its repetitions.
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import numpy as np

import oasiskv

Q_HEADS, KV_HEADS, HEAD_DIM, BATCH, BUDGET = 32, 8, 128, 8, 2048
ITERATIONS = 1000  # BM_CallOverhead's kIterations
CONTEXTS = (256, 4096)


def python_step_us(context, iterations):
    config = oasiskv.CacheConfig(num_layers=1, num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                 budget_tokens=BUDGET, max_sequences=BATCH,
                                 max_tokens_per_sequence=context + iterations + 16)
    cache = oasiskv.Cache(config, dtype="float16")
    rng = np.random.default_rng(1)
    batch = list(range(1, BATCH + 1))
    for s in batch:
        cache.add_sequence(s)
    prompt = rng.uniform(-1, 1, (context * BATCH, KV_HEADS, HEAD_DIM)).astype(np.float16)
    cache.append(batch, 0, prompt, prompt, rows_per_seq=[context] * BATCH)
    k = rng.uniform(-1, 1, (BATCH, KV_HEADS, HEAD_DIM)).astype(np.float16)
    v = rng.uniform(-1, 1, (BATCH, KV_HEADS, HEAD_DIM)).astype(np.float16)
    q = rng.uniform(-1, 1, (BATCH, Q_HEADS, HEAD_DIM)).astype(np.float32)
    previous = cache.prefetch(batch, 0, q)
    t0 = time.perf_counter()
    for _ in range(iterations):
        cache.append(batch, 0, k, v)
        nxt = cache.prefetch(batch, 0, q)
        cache.acquire(previous)
        cache.release(previous)
        previous = nxt
    return (time.perf_counter() - t0) / iterations * 1e6


def cpp_step_us(binary, repetitions):
    out = subprocess.run([binary, "--benchmark_filter=BM_CallOverhead", f"--benchmark_repetitions={repetitions}",
                          "--benchmark_format=json"], capture_output=True, text=True, check=True).stdout
    result = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("aggregate_name") == "median":
            context = int(b["run_name"].split("context:")[1].split("/")[0])
            scale = {"us": 1.0, "ms": 1e3, "ns": 1e-3}[b["time_unit"]]
            result[context] = b["real_time"] * scale
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpp-bench", default="build/bench/oasiskv_bench")
    ap.add_argument("--repetitions", type=int, default=5)
    args = ap.parse_args()
    cpp = cpp_step_us(args.cpp_bench, args.repetitions) if os.access(args.cpp_bench, os.X_OK) else {}
    print(f"oasiskv {oasiskv.__version__}: append + prefetch + acquire + release, one layer, batch {BATCH}, "
          f"{Q_HEADS}/{KV_HEADS} heads x {HEAD_DIM}, float16, budget {BUDGET}; {ITERATIONS} steps, "
          f"median of {args.repetitions}")
    print("| context | C++ (us/step) | Python (us/step) | Python / C++ | Python overhead (us/step) |")
    print("|---|---|---|---|---|")
    for context in CONTEXTS:
        py = statistics.median(python_step_us(context, ITERATIONS) for _ in range(args.repetitions))
        if context in cpp:
            c = cpp[context]
            print(f"| {context} | {c:.1f} | {py:.1f} | {py / c:.2f} | {py - c:.1f} |")
        else:
            print(f"| {context} | - | {py:.1f} | - | - |")


if __name__ == "__main__":
    main()
