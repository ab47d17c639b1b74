#!/usr/bin/env python3
"""Greedy decoding speed of SmolLM2-135M in Hugging Face transformers (float32, CPU): dense SDPA (the
model's own attention over a DynamicCache) against OasisKV (oasiskv.transformers.OasisKVCache, budget
1,024 tokens), at 1,024 / 4,096 / 8,000 tokens of context and 1 and 2 torch threads; then the same with
prompt-lookup drafts (prompt_lookup_num_tokens=3): acceptance, tokens per forward and tokens per second,
dense and OasisKV with the same drafter. Prints a table and one JSON line (--json also writes it).

Decode speed is timed from the first token to the last (a stopping criterion stamps each step), so the
prefill is left out. The prompt is the licenses of /usr/share/common-licenses concatenated (GPL-3 first),
cut to the context. For OasisKV each row also gives where a decode step's time goes (cache.timings:
append, plan = prefetch, acquire, attention over the view, release; the rest is the model).

Usage: bench_transformers.py [--contexts 1024,4096,8000] [--threads 1,2] [--budget 1024] [--tokens 64]
                             [--drafts 3] [--json PATH] [--quick]
--quick: tiny sizes (contexts 256 and 512, budget 128, 8 tokens, 1 thread) to check that it runs.
Needs `pip install .[transformers]` and scripts/fetch-model. Measure on an idle machine (the full run
makes 24 prefills of up to 8,000 tokens: tens of minutes on 2 cores).
"""
import argparse
import glob
import json
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList  # noqa: E402

import oasiskv  # noqa: E402
import oasiskv.transformers as okt  # noqa: E402

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class StepClock(StoppingCriteria):
    """Stamps the time and the sequence length after every forward of generate; never stops it."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.append((time.perf_counter(), input_ids.shape[1]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def decode_rate(self):
        """Tokens per second from the first generated token to the last (prefill excluded)."""
        (t0, n0), (t1, n1) = self.stamps[0], self.stamps[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else float("nan")

    def forward_ms(self):
        """Milliseconds a forward after the prefill."""
        return 1e3 * (self.stamps[-1][0] - self.stamps[0][0]) / max(1, len(self.stamps) - 1)


def prompt_tokens(tokenizer, length):
    files = sorted(glob.glob("/usr/share/common-licenses/*"), key=lambda f: (os.path.basename(f) != "GPL-3", f))
    ids = []
    for name in files:
        if os.path.isfile(name) and len(ids) < length:
            with open(name, encoding="utf-8", errors="replace") as f:
                ids += tokenizer(f.read()).input_ids
    if len(ids) < length:
        raise SystemExit(f"the licenses give {len(ids)} tokens, fewer than the context {length}")
    return torch.tensor([ids[:length]])


def run(model, ids, tokens, cache=None, drafts=0):
    """One greedy generate: (tokens per second, new tokens, forwards, draft rows proposed, seconds)."""
    clock = StepClock()
    rows = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(int(kwargs["input_ids"].shape[1])), with_kwargs=True)
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                  stopping_criteria=StoppingCriteriaList([clock]))
    if drafts:
        kwargs["prompt_lookup_num_tokens"] = drafts
    if cache is not None:
        kwargs[okt.CACHE_KWARG] = cache
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
    finally:
        hook.remove()
    seconds = time.perf_counter() - started
    decode = rows[1:]  # the forwards after the prefill (whose drafts, if any, are in rows[0])
    return dict(tokens_per_s=clock.decode_rate(), forward_ms=clock.forward_ms(), new=out[0, ids.shape[1]:].tolist(),
                forwards=len(rows), drafts=sum(r - 1 for r in decode), seconds=seconds)


def agreement(a, b):
    """Length of the common prefix of two token lists, as a share of the first."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n / max(1, len(a))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,8000")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens a run")
    ap.add_argument("--drafts", type=int, default=3, help="prompt_lookup_num_tokens (0: skip those runs)")
    ap.add_argument("--model-dir", default=os.environ.get("OASISKV_MODEL_DIR", os.path.join(REPO, ".cache", "models")))
    ap.add_argument("--json", help="also write the JSON line to this file")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: check that the script runs")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.threads, args.budget, args.tokens = "256,512", "1", 128, 8
    contexts = [int(c) for c in args.contexts.split(",")]
    threads = [int(t) for t in args.threads.split(",")]

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, gguf_file=MODEL_NAME, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, gguf_file=MODEL_NAME)
    rows = []
    header = (f"{'context':>7} {'thr':>3} {'drafts':>6} | {'dense tok/s':>11} {'oasis tok/s':>11} {'speedup':>7} | "
              f"{'same':>5} {'accept':>6} {'tok/fwd':>7} | oasis ms/step: append plan acquire attn release rest")
    print(f"SmolLM2-135M float32, budget {args.budget}, {args.tokens} new tokens; torch {torch.__version__}, "
          f"transformers {okt._hf.__version__}, oasiskv {oasiskv.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(header)
    for context in contexts:
        ids = prompt_tokens(tokenizer, context)
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for drafts in ([0, args.drafts] if args.drafts else [0]):
                dense = run(model, ids, args.tokens, drafts=drafts)
                cache = okt.OasisKVCache(model, budget_tokens=args.budget, max_batch=1,
                                         max_tokens=context + args.tokens + drafts + 8)
                cache.timings = cache.new_timings()
                oasis = run(model, ids, args.tokens, cache=cache, drafts=drafts)
                steps = max(1, cache.counters["forwards"] - 1)  # the decode forwards, timed by cache.timings
                parts = {k: v / steps * 1e3 for k, v in cache.timings.items()}
                step_ms = oasis["forward_ms"]
                row = dict(context=context, threads=n_threads, drafts=drafts, budget=args.budget,
                           dense_tokens_per_s=dense["tokens_per_s"], oasiskv_tokens_per_s=oasis["tokens_per_s"],
                           speedup=oasis["tokens_per_s"] / dense["tokens_per_s"],
                           same_tokens=agreement(dense["new"], oasis["new"]),
                           dense_forwards=dense["forwards"], oasiskv_forwards=oasis["forwards"],
                           dense_step_ms=dense["forward_ms"], oasiskv_step_ms=step_ms, oasiskv_parts_ms=parts,
                           blocks_fetched=cache.statistics().total().blocks_fetched)
                if drafts:
                    for name, r in (("dense", dense), ("oasiskv", oasis)):
                        accepted = len(r["new"]) - r["forwards"]  # a forward gives one token + accepted drafts
                        row[f"{name}_acceptance"] = accepted / r["drafts"] if r["drafts"] else float("nan")
                        row[f"{name}_tokens_per_forward"] = len(r["new"]) / r["forwards"]
                rows.append(row)
                rest = step_ms - sum(parts.values())
                accept = f"{row['oasiskv_acceptance']:6.2f}" if drafts else f"{'':6}"
                per_forward = f"{row['oasiskv_tokens_per_forward']:7.2f}" if drafts else f"{'':7}"
                print(f"{context:7d} {n_threads:3d} {drafts:6d} | {row['dense_tokens_per_s']:11.2f} "
                      f"{row['oasiskv_tokens_per_s']:11.2f} {row['speedup']:7.2f} | {row['same_tokens']:5.2f} {accept} "
                      f"{per_forward} | {parts['append']:.2f} {parts['plan']:.2f} {parts['acquire']:.2f} "
                      f"{parts['attention']:.2f} {parts['release']:.2f} {rest:.2f}", flush=True)
                del cache
    result = dict(bench="bench_transformers", model=MODEL_NAME, dtype="float32", budget=args.budget, tokens=args.tokens,
                  torch=torch.__version__, transformers=okt._hf.__version__, oasiskv=oasiskv.__version__,
                  cpus=os.cpu_count(), quick=args.quick, rows=rows)
    line = json.dumps(result)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    okt.detach(model)


if __name__ == "__main__":
    main()
