"""OasisKV inside Hugging Face transformers: a ``transformers.Cache`` that decodes through ``oasiskv.Cache``.

    import torch, oasiskv.transformers
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.float32)
    cache = oasiskv.transformers.OasisKVCache(model, budget_tokens=1024, max_batch=1, max_tokens=8192)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

Needs torch and transformers (``pip install oasiskv[transformers]``; tested with transformers 5.17 and
5.25, in the range ``TESTED_TRANSFORMERS``). ``CACHE_KWARG`` is the keyword this transformers takes a cache by
(``cache``, or ``past_key_values`` in 5.17). Constructing an OasisKVCache switches the model to the
attention implementation ``ATTENTION_NAME`` ("oasiskv"), which runs the original one for every forward
without an OasisKVCache; ``detach(model)`` restores the original.

The prefill attends densely and plans each layer's first working set; every later forward appends its
rows, plans the next step from its lookahead rows (the drafts of prompt lookup or an assistant model,
else the current row) and attends the previous plan's resident blocks, merging the remainder estimate
where one is configured. A model on the cpu gets a CPU ``oasiskv.Cache``, a model on one CUDA device a
CUDA one (the module built with the CUDA backend) on the device's current torch stream, and after the
prefill nothing on its decode path waits for the device.

One cache object serves one ``generate`` call (its sequences are that call's); ``reset()`` empties it
for the next. A call the cache cannot serve (another model, a batch above ``max_batch``, more tokens than
``max_tokens``, sliding-window or cross-attention models, right padding) raises ``oasiskv.Error`` naming
it before the cache changes.

The package, one job a module: requirements.py (what it needs from torch and transformers), dispatch.py
(the attention function in transformers' dispatch and the decoder's forward hooks), model_checks.py (the
model's shape and what the cache refuses), cache.py (OasisKVCache and its layer adapter, OasisKVLayer),
protocol.py (what a forward does to the cache), sequence_operations.py (crop, beam reorder, batch
selection), attention.py (attention over the view) and timing.py (``cache.timings``).
"""
from __future__ import annotations

from .requirements import CACHE_KWARG, TESTED_TRANSFORMERS, _hf  # noqa: F401  (first: says what to install)
from .cache import OasisKVCache, OasisKVLayer  # noqa: F401
from .dispatch import ATTENTION_NAME, detach

__all__ = ["OasisKVCache", "ATTENTION_NAME", "CACHE_KWARG", "TESTED_TRANSFORMERS", "detach"]
