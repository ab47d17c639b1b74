"""The ``vllm.general_plugins`` entry point (pyproject.toml): vLLM calls ``register`` in every process it starts.

On vLLM's CPU platform it overrides the ``CPU_ATTN`` backend (the one the platform always picks) with
OasisKV's, which is vLLM's own unless the engine was configured with ``oasiskv.vllm.engine_args``. Other
platforms are left alone (the CUDA backend is not wired yet: docs/vllm.md).
"""
from __future__ import annotations

BACKEND = "oasiskv.vllm.backend.OasisKVAttentionBackend"


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
