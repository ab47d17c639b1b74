"""OasisKV inside vLLM: serve many requests from a budget of device KV a request.

    import oasiskv.vllm
    from vllm import LLM
    llm = LLM(model=..., **oasiskv.vllm.engine_args(budget_tokens=1024, max_num_seqs=32))

The package is a vLLM plugin (the ``vllm.general_plugins`` entry point ``oasiskv``, plugin.py): installed, it
registers an attention backend that is vLLM's own CPU backend until an engine is configured with
``engine_args``, which names the OasisKV KV connector and carries the cache options. Such an engine keeps every
request's KV in an ``oasiskv.Cache`` (the full rows in its host tier, ``budget_tokens`` of each layer and kv head
resident), attends each decode step over the resident blocks planned from the previous step's lookahead rows
(drafts of ngram speculative decoding when configured), and vLLM's own pool holds a window of one block a
request, so more requests run at once in the same KV memory.

One job a module: settings.py (``engine_args``, ``serve_flags``, the checks at engine start, memory sizes),
plugin.py (the entry point), backend.py (the backend, its metadata builder and attention), connector.py (the
request lifecycle from the scheduler to the workers), runtime.py (a worker's cache and the map from requests
to sequences) and protocol.py (what a layer does to the cache). docs/vllm.md has the whole story.
"""
from __future__ import annotations

from .settings import (CONNECTOR, WINDOW_TOKENS, Settings, device_pool_bytes, engine_args,  # noqa: F401
                       sequences_that_fit, serve_flags)


def worker_statistics():
    """The OasisKV counters and cache statistics of this process's worker (single-process engines:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), or None before the first forward on OasisKV."""
    from .runtime import current_state

    state = current_state()
    return None if state is None else state.statistics()


__all__ = ["engine_args", "serve_flags", "sequences_that_fit", "device_pool_bytes", "worker_statistics"]
