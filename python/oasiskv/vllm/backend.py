"""The OasisKV attention backend: vLLM's CPU attention backend (``CPU_ATTN``), which the plugin overrides, with a
metadata builder that maps the forward onto the cache's sequences and an attention that runs the protocol
(protocol.py) over the resident blocks.

An engine not configured for OasisKV (no ``oasiskv.vllm.engine_args``) gets vLLM's CPU backend unchanged: every
method here defers to it. On OasisKV, each layer's device KV spec becomes a sliding window of
``WINDOW_TOKENS`` tokens, so vLLM's own pool holds only the blocks its scheduler writes (and admits requests by
that), vLLM's pool is never written, and the engine's KV memory is lowered by the OasisKV device pool.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)
from vllm.v1.kv_cache_interface import SlidingWindowSpec

from .. import Error
from . import runtime
from .protocol import forward_layer
from .settings import WINDOW_TOKENS, Settings, check_engine, device_pool_bytes, model_shape

# The settings of the engine whose model is being built in this process (customize_spec is a class method
# and sees no config); set by the attention's constructor, which runs first.
_ACTIVE: Settings | None = None


@dataclass
class OasisKVMetadata:
    """A forward's attention metadata on OasisKV: the Step (runtime.py) every layer uses."""

    num_actual_tokens: int
    step: runtime.Step


class OasisKVMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._oasiskv = Settings.of(vllm_config)
        self._vllm_config = vllm_config

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        if self._oasiskv is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        state = runtime.state_for(self._vllm_config, self._oasiskv)
        m = common_attn_metadata
        step = state.build_step(m.num_reqs, m.query_start_loc_cpu, m.seq_lens.cpu(), m.slot_mapping.cpu(),
                                m.num_actual_tokens)
        return OasisKVMetadata(num_actual_tokens=m.num_actual_tokens, step=step)


class OasisKVAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        global _ACTIVE
        config = get_current_vllm_config()
        self._oasiskv = settings = Settings.of(config)
        _ACTIVE = settings
        self._vllm_config = config
        self._layer = None
        if settings is None:
            return
        refused = [(attn_type != AttentionType.DECODER, f"attention type {attn_type}"),
                   (alibi_slopes is not None, "ALiBi"), (sinks is not None, "attention sinks"),
                   (bool(logits_soft_cap), f"logits_soft_cap={logits_soft_cap}"),
                   (sliding_window not in (None, -1), f"sliding_window={sliding_window}"),
                   (kv_cache_dtype not in ("auto", None), f"kv_cache_dtype={kv_cache_dtype}"),
                   (kv_sharing_target_layer_name is not None, "cross-layer KV sharing")]
        for bad, what in refused:
            if bad:
                raise Error(f"oasiskv.vllm: a layer with {what}; OasisKV serves causal decoder attention with a "
                            "KV cache of the model's dtype")
        _prepare_engine(config, settings)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if not isinstance(attn_metadata, OasisKVMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if self._layer is None:
            from vllm.model_executor.models.utils import extract_layer_index
            self._layer = extract_layer_index(layer.layer_name)
        state = runtime.state_for(self._vllm_config, self._oasiskv)
        forward_layer(state, self._layer, attn_metadata.step, query, key, value, output, self.scale, layer.isa)
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if self._oasiskv is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # OasisKV holds the rows (appended by forward): vLLM's pool is not written.


class OasisKVAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with OasisKV underneath when the engine is configured for it."""

    @staticmethod
    def get_impl_cls():
        return OasisKVAttentionImpl

    @staticmethod
    def get_builder_cls():
        return OasisKVMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        if _ACTIVE is None:
            return spec
        names = {f.name for f in dataclasses.fields(SlidingWindowSpec)} & {f.name for f in dataclasses.fields(spec)}
        fields = {name: getattr(spec, name) for name in names if name not in ("sliding_window",)}
        return SlidingWindowSpec(**fields, sliding_window=WINDOW_TOKENS)


def _prepare_engine(vllm_config, settings):
    """Once an engine: the checks of settings.check_engine, then the engine's KV memory lowered by the OasisKV
    device pool (vLLM's pool gets the rest)."""
    cache = vllm_config.cache_config
    if getattr(cache, "_oasiskv_checked", False):
        return
    check_engine(vllm_config, settings)
    pool = device_pool_bytes(settings.cache_config(vllm_config), model_shape(vllm_config).dtype)
    if cache.kv_cache_memory_bytes is not None:
        cache.kv_cache_memory_bytes = int(cache.kv_cache_memory_bytes) - pool
    cache._oasiskv_checked = True
    cache._oasiskv_pool_bytes = pool
