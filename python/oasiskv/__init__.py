"""OasisKV: a tiered sparse KV cache for LLM decode (the C++ library, via nanobind).

``oasiskv.Cache`` is the C++ ``Cache<cpu, T>``; a module built with the CUDA backend
(``pip install . -C cmake.define.OASISKV_PYTHON_CUDA=ON``; ``oasiskv.built_with_cuda()``) also gives
``Cache<cuda, T>`` with ``device="cuda:N"``. ``oasiskv.transformers`` (needs the ``transformers`` extra;
``import oasiskv`` does not) runs a Hugging Face transformers model's decode through either.

    import numpy as np, oasiskv
    config = oasiskv.CacheConfig(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64,
                                 budget_tokens=256, max_sequences=4, max_tokens_per_sequence=4096)
    cache = oasiskv.Cache(config, dtype="float32")
    cache.add_sequence(7)
    cache.append([7], 0, k, v, rows_per_seq=[1000])
    ticket = cache.prefetch([7], 0, q_lookahead)
    view = cache.acquire(ticket)   # LayerView: CSR arrays + zero-copy slot pool
    cache.release(ticket)

Arrays are taken without copies from anything numpy, DLPack (``__dlpack__``: torch, cupy, ...) or
the buffer protocol can hand over; a wrong dtype, shape, device or a non-contiguous array raises
oasiskv.Error naming it. Every oasiskv::Error of the C++ library is raised as oasiskv.Error.
``oasiskv.cpu_isa()`` names the instruction-set level the CPU kernels run at (``OASISKV_CPU_ISA``
caps it: scalar, avx2 or avx512).
"""
from ._oasiskv import (  # noqa: F401
    Cache,
    CacheConfig,
    Error,
    LayerStatistics,
    LayerView,
    Statistics,
    Ticket,
    __version__,
    built_with_cuda,
    cpu_isa,
    cpu_isa_supported,
    cuda_available,
    version_major,
    version_minor,
    version_patch,
)

__all__ = [
    "Cache",
    "CacheConfig",
    "Error",
    "LayerStatistics",
    "LayerView",
    "Statistics",
    "Ticket",
    "__version__",
    "built_with_cuda",
    "cpu_isa",
    "cpu_isa_supported",
    "cuda_available",
]
