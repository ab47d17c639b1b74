"""Throughput of vLLM on OasisKV against dense vLLM at one KV memory, measured in one run.

    VLLM_CPU_KVCACHE_SPACE=2 build/vllm-venv/bin/python bench/python/bench_vllm.py \\
        --requests 24 --prompt-tokens 8000 --output-tokens 128 --budget 1024

Each engine runs in its own process (vLLM keeps global state), on the same requests: N prompts of
``--prompt-tokens`` tokens of GPL-3 (each from another offset), greedy, ``--output-tokens`` tokens each (no
end-of-sequence stop). Both engines get ``max_num_seqs`` = ``oasiskv.vllm.sequences_that_fit`` for that memory
(OasisKV's device pool counted in it): how many dense vLLM runs at once is its own KV admission's call.
Reported per engine: requests running at once (vLLM's own scheduler's running list, its largest size), output
tokens per second over the whole run and over its decode-only steps (steps that carry no prompt rows), the KV
memory each used (vLLM's pool, OasisKV's device pool, OasisKV's host tier in use at its peak: the tier that
replaces HBM), and, for OasisKV, where its part of the time went (oasiskv.vllm.worker_statistics()).
``--json`` writes the results. Needs the vLLM venv (docs/vllm.md) and the converted model
(bench/python/gguf_to_safetensors.py, run on demand).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TEXT = "/usr/share/common-licenses/GPL-3"


def prompts_from_text(tokenizer, count, tokens):
    """`count` prompts of `tokens` tokens, cut from GPL-3 repeated, each from another offset."""
    ids = tokenizer(open(TEXT).read())["input_ids"]
    while len(ids) < tokens + 64 * count:
        ids = ids + ids
    return [{"prompt_token_ids": ids[64 * i:64 * i + tokens]} for i in range(count)]


def model_shape(model):
    """Layers, kv heads and head dim from the model folder's config.json."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    return {"layers": config["num_hidden_layers"], "kv_heads": config.get("num_key_value_heads", heads),
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads}


def child(args):
    """One engine: runs the requests and prints a JSON line of results."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    import oasiskv.vllm

    if args.kv_gib is not None:  # in bytes, below VLLM_CPU_KVCACHE_SPACE's whole GiB (which would override it)
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        kv_bytes = int(args.kv_gib * 2**30)
    else:
        kv_bytes = int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30)
    model_len = args.prompt_tokens + args.output_tokens + 64
    common = dict(model=str(args.model), dtype=args.dtype, max_model_len=model_len, enforce_eager=True,
                  enable_prefix_caching=False, max_num_batched_tokens=args.chunk)
    if args.kv_gib is not None:
        common["kv_cache_memory_bytes"] = kv_bytes
    shape = model_shape(args.model)
    per_token = shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2 * (4 if args.dtype == "float32" else 2)
    # Both engines may run as many requests as OasisKV fits: dense vLLM's own KV admission limits it.
    seqs = oasiskv.vllm.sequences_that_fit(kv_bytes, args.budget, **shape, dtype=args.dtype, chunk_tokens=args.chunk)
    seqs = max(1, min(seqs, args.requests))
    if args.mode == "dense":
        kwargs = dict(common, max_num_seqs=seqs)
    else:
        kwargs = dict(common, **oasiskv.vllm.engine_args(budget_tokens=args.budget, max_num_seqs=seqs))
    llm = LLM(**kwargs)
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    record = {"running": 0, "steps": [], "last": None}
    schedule = scheduler.schedule

    def counted_schedule(*a, **k):
        # A step's time: from its schedule call to the next one (the engine's loop: schedule, execute, update).
        now = time.perf_counter()
        last = record["last"]
        if last is not None:
            record["steps"].append((now - last[0],) + last[1])
        out = schedule(*a, **k)
        record["running"] = max(record["running"], len(scheduler.running))
        decode_only = not out.scheduled_new_reqs and all(
            n <= 1 + len(out.scheduled_spec_decode_tokens.get(r, ())) for r, n in out.num_scheduled_tokens.items())
        record["last"] = (now, (len(out.num_scheduled_tokens), decode_only)) if out.total_num_scheduled_tokens else None
        return out

    scheduler.schedule = counted_schedule
    prompts = prompts_from_text(llm.get_tokenizer(), args.requests, args.prompt_tokens)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if record["last"] is not None:  # the last step ended with generate
        record["steps"].append((time.perf_counter() - record["last"][0],) + record["last"][1])
    decode_steps = [s for s in record["steps"] if s[2]]
    decode_seconds = sum(s[0] for s in decode_steps)
    decode_tokens = sum(s[1] for s in decode_steps)
    cache = llm.llm_engine.vllm_config.cache_config
    result = dict(mode=args.mode, max_num_seqs=kwargs["max_num_seqs"], running_at_once=record["running"],
                  output_tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                  decode_steps=len(decode_steps), decode_tokens_per_s=decode_tokens / max(decode_seconds, 1e-9),
                  vllm_pool_gib=(cache.kv_cache_memory_bytes or 0) / 2**30,
                  oasiskv_pool_gib=getattr(cache, "_oasiskv_pool_bytes", 0) / 2**30)
    stats = oasiskv.vllm.worker_statistics()
    if stats is not None:
        result["oasiskv"] = {k: v for k, v in stats.items() if k != "statistics"}
        result["oasiskv_host_gib_at_end"] = stats["statistics"].host_bytes_in_use / 2**30
        result["oasiskv_host_gib_per_request"] = args.prompt_tokens * per_token / 2**30
    print("RESULT " + json.dumps(result), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (chunked prefill)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--modes", default="dense,oasiskv")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--kv-gib", type=float, default=None,
                        help="KV memory in GiB as kv_cache_memory_bytes (instead of VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ and args.kv_gib is None:
        raise SystemExit("bench_vllm: set VLLM_CPU_KVCACHE_SPACE (GiB): the KV memory both engines get")
    if args.model is None:
        from gguf_to_safetensors import convert
        args.model = convert()
    if args.mode:
        return child(args)
    results = []
    for mode in args.modes.split(","):
        command = [sys.executable, __file__, "--mode", mode] + [a for a in (argv or sys.argv[1:])]
        if "--model" not in command:
            command += ["--model", str(args.model)]
        run = subprocess.run(command, capture_output=True, text=True)
        line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
        if run.returncode != 0 or not line:
            sys.stderr.write(run.stdout[-4000:] + run.stderr[-8000:])
            raise SystemExit(f"bench_vllm: the {mode} engine failed (exit {run.returncode})")
        results.append(json.loads(line[0][7:]))
        print(json.dumps(results[-1]), flush=True)
    print(f"\nKV memory {args.kv_gib or os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB, {args.requests} requests of {args.prompt_tokens} "
          f"prompt + {args.output_tokens} output tokens, budget {args.budget}, {args.dtype}")
    print("| engine | max_num_seqs | running at once | output tok/s | decode-step tok/s | vLLM pool GiB | "
          "OasisKV pool GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['max_num_seqs']} | {r['running_at_once']} | {r['tokens_per_s']:.2f} | "
              f"{r['decode_tokens_per_s']:.2f} | {r['vllm_pool_gib']:.2f} | {r['oasiskv_pool_gib']:.2f} |")
    if len(results) == 2:
        a, b = results
        print(f"ratio {b['mode']}/{a['mode']}: output tok/s {b['tokens_per_s'] / a['tokens_per_s']:.2f}x, decode-step "
              f"tok/s {b['decode_tokens_per_s'] / a['decode_tokens_per_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
