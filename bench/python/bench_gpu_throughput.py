#!/usr/bin/env python3
"""The paper's throughput question on one GPU: decode through Hugging Face transformers with dense KV in
GPU memory against OasisKV (oasiskv.transformers.OasisKVCache on a CUDA oasiskv.Cache: a working set of
--budget tokens per (sequence, layer, kv head) on the GPU, the full KV in pinned host memory).

The model: Llama-3-8B's shape (hidden 4096, 32 query / 8 kv heads, head dim 128, intermediate 14336,
vocabulary 128256), randomly initialised in bfloat16 (nothing is downloaded), with --layers of its 32 layers
(default 4: weights and prefills of 32 layers do not fit the device time a check is given). Contexts of
--context tokens (default 32K).

(a) Decode step time at batch 1 and 8 (--batches): dense, the model's SDPA over the whole KV, held in a
    preallocated cache written in place (transformers' DynamicCache would copy the whole KV every step),
    filled with random K/V; OasisKV at --budget tokens (2,048) with fetch ratio 1.0 and 0.05, filled by a
    prefill forward of random tokens at batch 8 (the cache's first working set is planned from it; the cache
    takes K/V from forwards only), then batch 1 by batch_select_indices([0]). A step is one forward of one
    token per sequence, timed over --steps forwards after --warmup.
(b) At a fixed KV memory budget on the GPU (--kv-gib for the 32-layer model, default 40; the model with
    --layers L gets L/32 of it, and of --host-gib, so the batches are the 32-layer model's): the largest
    batch each mode fits (dense: the full KV of a sequence; OasisKV: its device memory per sequence,
    measured around the cache's construction; and the full KV in host memory within --host-gib), and
    tokens per second = batch / step time, the step time measured at that batch where it was run (dense,
    when memory and time allow), else extrapolated linearly from the measured batches (OasisKV: never
    lower than the host-link time of the measured bytes fetched per sequence and step). The ratio
    OasisKV / dense against the paper's 1.69x, and tools/serving_projection.py's model of the same setting
    (32 layers, the same KV budget, context, budget and fetch ratio, this GPU's HBM bandwidth and the
    host-to-device bandwidth measured here) beside it.

Prints a table and one JSON line at the end (--json PATH also writes it). --seconds: a time budget; the
stages run in order of value and those that would not fit are skipped (listed in the JSON), and SIGTERM
still prints what was measured. --smoke: tiny shapes on the CPU (2 layers, hidden 256, context 512, the
CPU cache) to check the script without a GPU.

Usage: bench_gpu_throughput.py [--layers 4] [--context 32768] [--budget 2048] [--fetch-ratios 0.05,1.0]
                               [--batches 1,8] [--kv-gib 40] [--host-gib 238] [--steps 16] [--warmup 3]
                               [--seconds S] [--device cuda] [--json PATH] [--smoke]
Needs torch, transformers and the oasiskv module with the CUDA backend (pip install .[transformers]
-C cmake.define.OASISKV_PYTHON_CUDA=ON); scripts/gpu-check runs it.
"""
import argparse
import gc
import json
import math
import os
import signal
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache as HFCache
from transformers.cache_utils import CacheLayerMixin

import oasiskv
import oasiskv.transformers as okt

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PAPER_RATIO = 1.69  # the paper: 2,083 / 1,235 tok/s (Qwen3-8B, H100, AIME24)
FULL_LAYERS = 32  # Llama-3-8B
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256)
SMOKE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
             vocab_size=1024)
GIB = 2 ** 30


class Stop(Exception):
    """SIGTERM (gpu-check's timeout): stop measuring, print what was measured."""


# ---- dense: a preallocated KV written in place ----------------------------------------------------


class DenseLayer(CacheLayerMixin):
    """One layer's K/V in buffers of `capacity` tokens: update writes the new rows in place and returns the
    first `length` rows (views), so a decode step reads the KV once and copies nothing else."""

    is_compileable = False
    is_sliding = False

    def __init__(self, capacity):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def allocate(self, batch, kv_heads, head_dim, dtype, device):
        self.keys = torch.empty(batch, kv_heads, self.capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.dtype, self.device = dtype, torch.device(device)
        self.is_initialized = True

    def fill_random(self, tokens, generator=None):
        self.keys[:, :, :tokens].normal_(generator=generator)
        self.values[:, :, :tokens].normal_(generator=generator)
        self.length = tokens

    def lazy_initialization(self, key_states, value_states=None):
        batch, kv_heads, _, head_dim = key_states.shape
        self.allocate(batch, kv_heads, head_dim, key_states.dtype, key_states.device)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.length + n > self.capacity:
            raise RuntimeError(f"DenseLayer: {self.length + n} tokens, above its capacity {self.capacity}")
        self.keys[:, :, self.length:self.length + n].copy_(key_states)
        self.values[:, :, self.length:self.length + n].copy_(value_states)
        self.length += n
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]

    def get_mask_sizes(self, query_length, *args):
        return self.length + int(query_length), 0

    def get_seq_length(self, *args):
        return self.length

    def get_max_length(self):
        return -1

    def get_max_cache_shape(self):
        return -1

    def reset(self):
        self.length = 0

    def offload(self):
        pass

    def prefetch(self):
        pass


def dense_cache(config, layers, batch, tokens, capacity, dtype, device):
    cache = HFCache(layers=[DenseLayer(capacity) for _ in range(layers)])
    generator = torch.Generator(device=device).manual_seed(7)
    for layer in cache.layers:
        layer.allocate(batch, config.num_key_value_heads, config.head_dim, dtype, device)
        layer.fill_random(tokens, generator)
    return cache


# ---- measuring --------------------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward(model, cache, tokens):
    out = model(input_ids=tokens, use_cache=True, logits_to_keep=1, **{okt.CACHE_KWARG: cache})
    return out.logits[:, -1:].argmax(-1)  # the next tokens, left on the device


def time_steps(model, cache, batch, args, device, vocab):
    """Seconds a decode step (one token per sequence), over args.steps forwards after args.warmup."""
    tokens = torch.randint(3, vocab, (batch, 1), device=device)
    with torch.inference_mode():
        for _ in range(args.warmup):
            tokens = forward(model, cache, tokens)
        sync(device)
        started = time.perf_counter()
        for _ in range(args.steps):
            tokens = forward(model, cache, tokens)
        sync(device)
    return (time.perf_counter() - started) / args.steps


def host_link_gbps(device):
    """Pinned host -> device bandwidth (GB/s) of a 256 MiB copy: the path OasisKV's gathers take."""
    if device.type != "cuda":
        return None
    host = torch.empty(256 * 2 ** 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    dev.copy_(host, non_blocking=True)
    sync(device)
    started = time.perf_counter()
    for _ in range(4):
        dev.copy_(host, non_blocking=True)
    sync(device)
    return 4 * host.numel() / (time.perf_counter() - started) / 1e9


def hbm_tbps(name):
    """HBM bandwidth (TB/s) by the device's name, for the projection (None: the projection's default)."""
    for key, value in (("H200", 4.8), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100", 2.0)):
        if key in name:
            return value
    return None


def fit_line(points):
    """(a, c) of t = a + c * batch, least squares over {batch: seconds}; one point: c = 0."""
    xs, ys = list(points), [points[b] for b in points]
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - c * mx, max(c, 0.0)


def step_at(points, batch, link_floor_s=0.0):
    """(seconds, how): measured at `batch`, else extrapolated from the measured batches."""
    if batch in points:
        return points[batch], f"measured at batch {batch}"
    if not points:
        return None, "not measured"
    a, c = fit_line(points)
    t = a + c * batch
    how = f"extrapolated linearly from batches {sorted(points)}"
    if link_floor_s > t:
        t, how = link_floor_s, how + ", raised to the host-link time of the measured traffic"
    return t, how


def projection(args, fetch_ratio, link_gbps, hbm, blocks_per_head):
    """tools/serving_projection.py's model of the same setting: the 32-layer model, the same KV budget
    (HBM = weights + KV budget, all of it usable), prompt = context, no output, budget, fetch ratio."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import serving_projection as sp

    shape = LLAMA3_8B
    per_layer = (2 * shape["hidden_size"] * shape["num_attention_heads"] * shape["head_dim"]
                 + 2 * shape["hidden_size"] * shape["num_key_value_heads"] * shape["head_dim"]
                 + 3 * shape["hidden_size"] * shape["intermediate_size"])
    params = FULL_LAYERS * per_layer + 2 * shape["vocab_size"] * shape["hidden_size"]
    weights_gb = params * 2 / 1e9
    argv = ["--layers", str(FULL_LAYERS), "--q-heads", "32", "--kv-heads", "8", "--head-dim", "128",
            "--dtype-bytes", "2", "--weights-gb", f"{weights_gb:.3f}",
            "--hbm-gb", f"{weights_gb + args.kv_gib * GIB / 1e9:.3f}", "--mem-util", "1", "--reserve-gb", "0",
            "--prompt", str(args.context), "--output", "0", "--budget", str(args.budget),
            "--fetch-ratio", str(fetch_ratio), "--max-batch", "100000", "--host-gb", f"{args.host_gib * GIB / 1e9:.1f}"]
    if hbm:
        argv += ["--hbm-tbps", str(hbm)]
    if link_gbps:
        argv += ["--link-gbps", f"{link_gbps:.1f}"]
    a = sp.parser().parse_args(argv)
    cap = sp.project(a, args.context, sp.cap_blocks(a) * a.fetch_utilisation)
    out = dict(assumed_traffic="the fetch cap, full", dense_batch=cap["dense_batch"], oasis_batch=cap["oasis_batch"],
               dense_tokens_per_s=cap["dense_tps"], oasis_tokens_per_s=cap["oasis_tps"], ratio=cap["ratio"],
               oasis_bound=cap["oasis_bound"])
    if blocks_per_head is not None:
        measured = sp.project(a, args.context, blocks_per_head)
        out.update(ratio_with_measured_traffic=measured["ratio"], measured_blocks_per_head=blocks_per_head)
    return out


# ---- the run ------------------------------------------------------------------------------------------


def build_model(args, device):
    shape = SMOKE if args.smoke else LLAMA3_8B
    config = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=args.context + 4096,
                         tie_word_embeddings=False, attn_implementation="sdpa", **shape)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bfloat16 on the device: no float32 copy, no host init
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval(), config


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--layers", type=int, default=4, help="layers of Llama-3-8B's 32 to build (default 4)")
    ap.add_argument("--context", type=int, default=32768, help="tokens of context per sequence")
    ap.add_argument("--budget", type=int, default=2048, help="OasisKV tokens per (sequence, layer, kv head)")
    ap.add_argument("--fetch-ratios", default="0.05,1.0", help="OasisKV fetch ratios, in the order they run")
    ap.add_argument("--batches", default="1,8", help="batches of the step-time measurements (the largest is "
                    "prefilled, the others selected from it)")
    ap.add_argument("--kv-gib", type=float, default=40.0, help="GPU memory for KV of the 32-layer model, GiB")
    ap.add_argument("--host-gib", type=float, default=238.4,
                    help="host memory for OasisKV's full KV of the 32-layer model, GiB (default: "
                         "serving_projection's 256 GB per GPU)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps a measurement")
    ap.add_argument("--warmup", type=int, default=3, help="decode steps before the timed ones")
    ap.add_argument("--seconds", type=float, default=600.0, help="time budget: stages that would not fit are skipped")
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda; cpu with --smoke)")
    ap.add_argument("--json", help="also write the JSON line to this file")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU (2 layers, hidden 256, context 512, budget 128): checks the script")
    args = ap.parse_args()
    started = time.perf_counter()
    if args.smoke:
        args.layers, args.context, args.budget = 2, 512, 128
        args.steps, args.warmup, args.batches = min(args.steps, 3), 1, "1,2"
        torch.set_num_threads(1)
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_gpu_throughput: torch sees no CUDA device (--smoke runs on the CPU)")
        if not oasiskv.cuda_available():
            raise SystemExit("bench_gpu_throughput: this oasiskv module has no CUDA backend or sees no GPU "
                             f"(built_with_cuda={oasiskv.built_with_cuda()})")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    deadline = started + args.seconds
    batches = sorted({int(b) for b in args.batches.split(",")})
    ratios = [float(r) for r in args.fetch_ratios.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    scale = args.layers / FULL_LAYERS
    result = dict(bench="bench_gpu_throughput", device=name, torch=torch.__version__,
                  transformers=transformers.__version__, oasiskv=oasiskv.__version__, smoke=args.smoke,
                  model=dict(shape="smoke" if args.smoke else "Llama-3-8B", layers=args.layers, of_layers=FULL_LAYERS,
                             dtype="bfloat16", weights="random"),
                  context=args.context, budget=args.budget, batches=batches, steps=args.steps,
                  fill=dict(dense="random K/V written into a preallocated cache",
                            oasiskv=f"a prefill forward of random tokens at batch {batches[-1]}; smaller batches "
                                    "by batch_select_indices"),
                  step_ms={}, oasiskv_runs={}, skipped=[], errors={})

    def on_term(signum, frame):
        raise Stop()

    signal.signal(signal.SIGTERM, on_term)

    def left():
        return deadline - time.perf_counter()

    try:
        model, config = build_model(args, device)
        vocab, kv_heads, head_dim = config.vocab_size, config.num_key_value_heads, config.head_dim
        kv_per_token = 2 * args.layers * kv_heads * head_dim * 2  # bytes, bfloat16
        dense_per_seq = args.context * kv_per_token
        link = host_link_gbps(device)
        result.update(host_link_gbps=link, seconds_setup=time.perf_counter() - started)
        print(f"bench_gpu_throughput on {name}: {result['model']['shape']} shape, {args.layers} of {FULL_LAYERS} "
              f"layers, bfloat16, random weights; context {args.context}, OasisKV budget {args.budget}; "
              f"host link {link or 0:.1f} GB/s; torch {torch.__version__}, transformers {transformers.__version__}",
              flush=True)
        capacity = args.context + args.warmup + args.steps + 8
        dense_points = {}

        def measure_dense(batch):
            # A dense cache of `batch` sequences filled with random K/V, its decode step timed, then freed.
            cache = dense_cache(config, args.layers, batch, args.context, capacity, torch.bfloat16, device)
            dense_points[batch] = time_steps(model, cache, batch, args, device, vocab)
            result["step_ms"].setdefault("dense", {})[str(batch)] = dense_points[batch] * 1e3
            print(f"dense   batch {batch:4d}: {dense_points[batch] * 1e3:8.2f} ms a step", flush=True)
            del cache
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

        # (a) dense at the measured batches: cheap (no prefill).
        for batch in batches:
            if left() < 10:
                result["skipped"].append(f"dense batch {batch}")
                continue
            measure_dense(batch)

        # (a) OasisKV at each fetch ratio: one prefill at the largest batch, then the smaller batches.
        oasis_points, device_per_seq, traffic = {}, {}, {}
        prefill_s = None
        for ratio in ratios:
            key = f"oasiskv_fr{ratio:g}"
            need = 3 * (prefill_s or 10.0) + 5
            if left() < need:
                result["skipped"].append(f"{key} (needs about {need:.0f} s, {left():.0f} s left)")
                continue
            try:
                points, per_seq, fetched = run_oasis(model, args, batches, ratio, device, vocab, key, result)
            except Stop:
                raise
            except Exception as error:  # noqa: BLE001 - recorded, the other stages still run
                result["errors"][key] = f"{type(error).__name__}: {error}"
                print(f"{key}: FAILED: {error}", flush=True)
                continue
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            prefill_s = result["oasiskv_runs"][key]["prefill_s"]
            oasis_points[key], device_per_seq[key], traffic[key] = points, per_seq, fetched

        # (b) the largest batch each mode fits in the KV budget, and its tokens per second.
        kv_budget = args.kv_gib * GIB * scale
        host_budget = args.host_gib * GIB * scale
        dense_batch = int(kv_budget // dense_per_seq)
        fit = dict(kv_budget_gib=kv_budget / GIB, host_budget_gib=host_budget / GIB,
                   scale=f"{args.layers}/{FULL_LAYERS} of --kv-gib {args.kv_gib} and --host-gib {args.host_gib}")
        # Dense at its own largest batch where memory and time allow: a measurement instead of a line.
        if dense_batch >= 1 and dense_batch not in dense_points:
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
            need_bytes = dense_batch * capacity * kv_per_token + 4 * GIB
            if device.type != "cuda":
                result["skipped"].append(f"dense at batch {dense_batch} (not run on the CPU): extrapolated")
            elif need_bytes > free:
                result["skipped"].append(f"dense at batch {dense_batch} ({need_bytes / GIB:.1f} GiB needed, "
                                         f"{free / GIB:.1f} GiB free): extrapolated")
            elif left() < 15:
                result["skipped"].append(f"dense at batch {dense_batch} (time): extrapolated")
            else:
                measure_dense(dense_batch)
        dense_step, dense_how = step_at({b: t for b, t in dense_points.items()}, dense_batch)
        dense_tps = dense_batch / dense_step if dense_step and dense_batch else None
        fit["dense"] = dict(per_seq_gib=dense_per_seq / GIB, batch=dense_batch,
                            step_ms=dense_step * 1e3 if dense_step else None, step=dense_how, tokens_per_s=dense_tps)
        ratios_out = {}
        for key, points in oasis_points.items():
            per_seq = device_per_seq[key]
            batch = int(min(kv_budget // per_seq["bytes"], host_budget // dense_per_seq))
            bytes_per_seq_step = traffic[key]["bytes_per_seq_step"]
            floor = batch * bytes_per_seq_step / (link * 1e9) if link and bytes_per_seq_step else 0.0
            step, how = step_at(points, batch, floor)
            tps = batch / step if step and batch else None
            fit[key] = dict(device_per_seq_gib=per_seq["bytes"] / GIB, device_per_seq=per_seq["how"], batch=batch,
                            bound="GPU memory" if kv_budget // per_seq["bytes"] <= host_budget // dense_per_seq
                            else "host memory",
                            step_ms=step * 1e3 if step else None, step=how, link_floor_ms=floor * 1e3,
                            tokens_per_s=tps)
            if tps and dense_tps:
                ratios_out[key] = tps / dense_tps
        result["fit"] = fit
        result["ratio"] = ratios_out
        result["paper_ratio"] = PAPER_RATIO
        hbm = hbm_tbps(name)
        result["projection"] = {}
        for ratio in ratios:
            key = f"oasiskv_fr{ratio:g}"
            blocks = traffic.get(key, {}).get("blocks_per_head_step")
            try:
                result["projection"][key] = projection(args, ratio, link, hbm, blocks)
            except Exception as error:  # noqa: BLE001
                result["errors"][f"projection {key}"] = f"{type(error).__name__}: {error}"
        print_table(result)
    except Stop:
        result["skipped"].append("the rest: stopped by SIGTERM (the time limit)")
    finally:
        result["seconds"] = time.perf_counter() - started
        line = json.dumps(result)
        print(line, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                f.write(line + "\n")
    return 1 if result["errors"] else 0


def run_oasis(model, args, batches, ratio, device, vocab, key, result):
    """Step times of OasisKV at `ratio` for each batch (largest first, from one prefill), the cache's
    device memory per sequence and its traffic per sequence and step at the largest batch."""
    biggest = batches[-1]
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
    max_tokens = args.context + len(batches) * (args.warmup + args.steps) + 16
    cache = okt.OasisKVCache(model, budget_tokens=args.budget, max_batch=biggest, max_tokens=max_tokens,
                             fetch_ratio=ratio)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        per_seq = dict(bytes=max(used, 1) / biggest, how=f"measured: the device memory the cache took for {biggest} "
                                                 "sequences (its fixed part included), over the sequences")
    else:
        layers, _, kv_heads, head_dim = cache.shape
        slots = cache.native.slots_per_layer * layers * 2 * cache.cache_config.block_tokens * head_dim * 2
        summaries = math.ceil(max_tokens / cache.cache_config.block_tokens) * layers * kv_heads * 2 * head_dim * 4
        per_seq = dict(bytes=slots / biggest + summaries, how="analytic (CPU run): slots plus float32 key summaries")
    entry = result["oasiskv_runs"][key] = dict(fetch_ratio=ratio, device_per_seq_mib=per_seq["bytes"] / 2 ** 20)
    prompt = torch.randint(3, vocab, (biggest, args.context), device=device)
    started = time.perf_counter()
    with torch.inference_mode():
        token = forward(model, cache, prompt)
    sync(device)
    entry["prefill_s"] = time.perf_counter() - started
    del prompt, token
    points, fetched = {}, {}
    for batch in reversed(batches):
        if batch != cache.batch_size:
            cache.batch_select_indices(list(range(batch)))
        stats = cache.statistics().total()
        cache.timings = cache.new_timings()
        points[batch] = time_steps(model, cache, batch, args, device, vocab)
        after = cache.statistics().total()
        steps = args.warmup + args.steps
        host_ms = {part: seconds / steps * 1e3 for part, seconds in cache.timings.items()}
        cache.timings = None
        per_step = dict(blocks_per_seq_step=(after.blocks_fetched - stats.blocks_fetched) / steps / batch,
                        bytes_per_seq_step=(after.bytes_fetched - stats.bytes_fetched) / steps / batch)
        per_step["blocks_per_head_step"] = per_step["blocks_per_seq_step"] / (args.layers * cache.shape[2])
        if batch == biggest:
            fetched = per_step
        entry[f"batch_{batch}"] = dict(step_ms=points[batch] * 1e3, host_ms_per_step=host_ms, **per_step)
        result["step_ms"].setdefault(key, {})[str(batch)] = points[batch] * 1e3
        print(f"{key:8s} batch {batch:4d}: {points[batch] * 1e3:8.2f} ms a step, "
              f"{per_step['blocks_per_seq_step']:.1f} blocks fetched a sequence and step "
              f"(prefill {entry['prefill_s']:.1f} s)", flush=True)
    cache.reset()
    del cache
    return points, per_seq, fetched


def print_table(result):
    print()
    print("| mode | per-sequence memory on the GPU | batch in the KV budget | step | tokens/s | / dense |")
    print("|---|---|---|---|---|---|")
    fit = result["fit"]
    dense = fit["dense"]

    def ms(x):
        return f"{x:.2f} ms" if x else "-"

    def tps(x):
        return f"{x:,.0f}" if x else "-"
    print(f"| dense | {dense['per_seq_gib']:.3f} GiB | {dense['batch']} | {ms(dense['step_ms'])} ({dense['step']}) | "
          f"{tps(dense['tokens_per_s'])} | 1.00x |")
    for key, row in fit.items():
        if not key.startswith("oasiskv"):
            continue
        ratio = result["ratio"].get(key)
        print(f"| {key} | {row['device_per_seq_gib']:.3f} GiB | {row['batch']} ({row['bound']}) | "
              f"{ms(row['step_ms'])} ({row['step']}) | {tps(row['tokens_per_s'])} | "
              f"{f'{ratio:.2f}x' if ratio else '-'} |")
    print(f"KV budget {fit['kv_budget_gib']:.2f} GiB, host {fit['host_budget_gib']:.1f} GiB ({fit['scale']}); the "
          f"paper: {result['paper_ratio']}x")
    for key, p in result["projection"].items():
        extra = (f", {p['ratio_with_measured_traffic']:.2f}x with the measured traffic"
                 if "ratio_with_measured_traffic" in p else "")
        print(f"serving_projection.py, {key}: dense batch {p['dense_batch']}, OasisKV batch {p['oasis_batch']} "
              f"({p['oasis_bound']}-bound), {p['ratio']:.2f}x{extra}")
    if result["skipped"]:
        print("skipped: " + "; ".join(result["skipped"]))
    print()


if __name__ == "__main__":
    sys.exit(main())
