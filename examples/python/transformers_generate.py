#!/usr/bin/env python3
"""SmolLM2-135M in Hugging Face transformers, decoding through OasisKV: 512 resident tokens of a
2,000-token prompt per layer and kv head, next to dense attention.
Run after `pip install .[transformers]` and `scripts/fetch-model`: python3 examples/python/transformers_generate.py"""
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is the local GGUF, no hub
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oasiskv.transformers import CACHE_KWARG, OasisKVCache

folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".cache", "models")
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
with open("/usr/share/common-licenses/GPL-3") as f:
    prompt = tokenizer(f.read(), return_tensors="pt").input_ids[:, :2000]

for name in ("dense", "oasiskv"):
    kwargs = dict(max_new_tokens=48, do_sample=False)
    if name == "oasiskv":  # one cache per generate call (cache.reset() empties it for another)
        cache = OasisKVCache(model, budget_tokens=512, max_batch=1, max_tokens=4096)
        kwargs[CACHE_KWARG] = cache  # "cache", or "past_key_values" in older transformers
    started = time.perf_counter()
    out = model.generate(prompt, **kwargs)
    print(f"{name} ({time.perf_counter() - started:.1f} s):", repr(tokenizer.decode(out[0, prompt.shape[1]:])))
stats = cache.statistics().total()
print(f"OasisKV: {stats.blocks_fetched} blocks fetched, {stats.acquires} views attended")
