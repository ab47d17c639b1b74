"""What an engine runs OasisKV with: ``engine_args`` (the keyword arguments of ``vllm.LLM`` / ``EngineArgs``),
the ``Settings`` the engine's processes read back from its config, the device memory they take, and the
checks that refuse a configuration OasisKV cannot serve, at engine start, naming the setting.

The settings travel inside vLLM's own config, as the KV connector's extra config (``kv_transfer_config``):
every process of the engine (scheduler, workers) reads the same ones, and ``vllm serve`` takes them as one
flag. Without that connector in the config, the plugin leaves vLLM as it was.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import CacheConfig, Error

CONNECTOR = "OasisKVConnector"
CONNECTOR_MODULE = "oasiskv.vllm.connector"
EXTRA_KEY = "oasiskv"
# vLLM's own pool keeps the window of each request's newest tokens (its spec is a sliding window of this
# many tokens): OasisKV holds the sequence, so vLLM needs only the blocks its scheduler writes.
WINDOW_TOKENS = 1

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def engine_args(budget_tokens: int = 1024, *, max_num_seqs: int = 16, **cache_options) -> dict:
    """Keyword arguments that run a ``vllm.LLM`` (or ``EngineArgs``) on OasisKV:

        LLM(model=..., **oasiskv.vllm.engine_args(budget_tokens=1024, max_num_seqs=32))

    ``budget_tokens``: tokens of each (sequence, layer, kv head) resident on the device; ``max_num_seqs``:
    requests running at once, which is also the OasisKV cache's sequences (its device pool is sized for them
    and counted in the KV memory the engine is given); ``cache_options``: any other ``oasiskv.CacheConfig``
    field (``remainder="quantized"``, ``recent_tokens``, ``scorer``, ...) except those the model sets. The
    arguments also turn prefix caching off (a shared prefix is not yet mapped to ``fork``) and CUDA graphs off
    (the backend calls the host between kernels). ``vllm serve`` takes the same as flags: ``serve_flags``.
    """
    from vllm.config import KVTransferConfig

    settings = {"budget_tokens": int(budget_tokens), **cache_options}
    _check_options(settings)
    return {
        "kv_transfer_config": KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE,
                                               kv_role="kv_both", kv_connector_extra_config={EXTRA_KEY: settings}),
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "max_num_seqs": int(max_num_seqs),
    }


def serve_flags(budget_tokens: int = 1024, *, max_num_seqs: int = 16, **cache_options) -> list[str]:
    """``engine_args`` as ``vllm serve`` flags."""
    settings = {"budget_tokens": int(budget_tokens), **cache_options}
    _check_options(settings)
    transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
                "kv_connector_extra_config": {EXTRA_KEY: settings}}
    return ["--kv-transfer-config", json.dumps(transfer), "--no-enable-prefix-caching", "--enforce-eager",
            "--max-num-seqs", str(int(max_num_seqs))]


_MODEL_FIELDS = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "softmax_scale", "max_tokens_per_sequence")


def _check_options(options: dict) -> None:
    for name in options:
        if name in _MODEL_FIELDS:
            raise Error(f"oasiskv.vllm: {name} comes from the model and the engine (max_num_seqs, max_model_len); "
                        "leave it out")
        if name != "budget_tokens" and not hasattr(CacheConfig, name):
            raise Error(f"oasiskv.vllm: {name!r} is not an oasiskv.CacheConfig field")


@dataclass
class Settings:
    """The OasisKV settings of one engine, read from its VllmConfig."""

    budget_tokens: int
    options: dict = field(default_factory=dict)

    @staticmethod
    def of(vllm_config) -> "Settings | None":
        """The engine's settings, or None where it was not configured for OasisKV (vLLM runs as before)."""
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        if transfer is None or transfer.kv_connector != CONNECTOR:
            return None
        extra = dict((transfer.kv_connector_extra_config or {}).get(EXTRA_KEY, {}))
        budget = int(extra.pop("budget_tokens", 1024))
        return Settings(budget, extra)

    def cache_config(self, vllm_config) -> CacheConfig:
        """The oasiskv.CacheConfig for this engine's model, max_num_seqs and max_model_len."""
        shape = model_shape(vllm_config)
        options = dict(self.options)
        # The cache's sequences: max_num_seqs unless set (check_engine refuses fewer).
        sequences = int(options.pop("max_sequences", vllm_config.scheduler_config.max_num_seqs))
        return CacheConfig(num_layers=shape.layers, num_q_heads=shape.q_heads, num_kv_heads=shape.kv_heads,
                           head_dim=shape.head_dim, budget_tokens=self.budget_tokens, max_sequences=sequences,
                           max_tokens_per_sequence=int(vllm_config.model_config.max_model_len),
                           softmax_scale=0.0, **options)


@dataclass
class ModelShape:
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str


def model_shape(vllm_config) -> ModelShape:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = str(model.dtype).replace("torch.", "")
    return ModelShape(layers=int(model.get_num_layers(parallel)),
                      q_heads=int(model.get_num_attention_heads(parallel)),
                      kv_heads=int(model.get_num_kv_heads(parallel)), head_dim=int(model.get_head_size()),
                      dtype=dtype)


def device_pool_bytes(cache_config: CacheConfig, dtype: str) -> int:
    """Bytes of the OasisKV cache's device slot pool: every layer's slots (budget blocks of each sequence's kv
    heads), keys and values."""
    blocks = -(-cache_config.budget_tokens // cache_config.block_tokens)
    slots = cache_config.max_sequences * cache_config.num_kv_heads * blocks
    return (cache_config.num_layers * slots * 2 * cache_config.block_tokens * cache_config.head_dim
            * _BYTES[dtype])


def sequences_that_fit(kv_bytes: int, budget_tokens: int, *, layers: int, kv_heads: int, head_dim: int,
                       dtype: str = "bfloat16", block_tokens: int = 16, vllm_block_tokens: int = 128,
                       chunk_tokens: int = 2048) -> int:
    """Requests an engine on OasisKV runs at once in `kv_bytes` of KV memory: each takes its OasisKV budget
    (the device pool) and vLLM's window (one block of its own pool), and the prefill chunk's blocks are held
    once. What a caller passes as ``max_num_seqs``."""
    per_token = layers * kv_heads * head_dim * 2 * _BYTES[dtype]
    budget = -(-budget_tokens // block_tokens) * block_tokens
    chunk = (-(-chunk_tokens // vllm_block_tokens) + 1) * vllm_block_tokens * per_token
    per_request = (budget + vllm_block_tokens) * per_token
    return max(0, (kv_bytes - chunk) // per_request)


def check_engine(vllm_config, settings: Settings) -> None:
    """Refuses, naming the setting, what OasisKV cannot serve: prefix caching, CUDA graphs, a model with
    sliding-window, MLA or encoder-decoder attention, a budget above max_model_len, max_num_seqs above the
    cache's sequences, and a device pool that does not fit the engine's KV memory."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching:
        raise Error("oasiskv.vllm: enable_prefix_caching=True: prefix caching is not supported yet (a shared "
                    "prefix is not mapped to oasiskv fork); set enable_prefix_caching=False (--no-enable-prefix-caching)")
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is not None and str(getattr(mode, "name", mode)) not in ("NONE", "None") and not model.enforce_eager:
        raise Error(f"oasiskv.vllm: CUDA graphs (cudagraph_mode={getattr(mode, 'name', mode)}, enforce_eager=False):"
                    " the OasisKV backend calls the host between kernels and is not capture-safe; set "
                    "enforce_eager=True (--enforce-eager)")
    if getattr(model, "is_encoder_decoder", False):
        raise Error(f"oasiskv.vllm: model {model.model} is encoder-decoder; OasisKV serves decoder-only models")
    if getattr(model, "use_mla", False):
        raise Error(f"oasiskv.vllm: model {model.model} uses MLA (latent attention); OasisKV serves multi-head / "
                    "grouped-query attention")
    window = model.get_sliding_window() if hasattr(model, "get_sliding_window") else None
    layer_types = getattr(model.hf_text_config, "layer_types", None) or []
    if window or any(str(t) not in ("full_attention", "attention") for t in layer_types):
        raise Error(f"oasiskv.vllm: model {model.model} has sliding-window or other non-full attention layers "
                    f"(sliding_window={window}, layer_types={sorted(set(map(str, layer_types)))}); OasisKV serves "
                    "full attention")
    if settings.budget_tokens > model.max_model_len:
        raise Error(f"oasiskv.vllm: budget_tokens={settings.budget_tokens} is above max_model_len="
                    f"{model.max_model_len}; a budget covering every request is dense attention: lower it")
    max_seqs = int(vllm_config.scheduler_config.max_num_seqs)
    cap = settings.options.get("max_sequences")
    if cap is not None and max_seqs > int(cap):
        raise Error(f"oasiskv.vllm: max_num_seqs={max_seqs} is above the cache's max_sequences={cap}")
    config = settings.cache_config(vllm_config)
    try:
        config.validate()
    except Exception as error:  # the library names the field
        raise Error(f"oasiskv.vllm: {error}") from None
    kv_bytes = cache.kv_cache_memory_bytes
    if kv_bytes is not None:
        pool = device_pool_bytes(config, model_shape(vllm_config).dtype)
        if pool >= kv_bytes:
            raise Error(f"oasiskv.vllm: the OasisKV device pool for max_num_seqs={max_seqs} and budget_tokens="
                        f"{settings.budget_tokens} takes {pool / 2**30:.2f} GiB, not less than the engine's KV memory "
                        f"(kv_cache_memory_bytes / VLLM_CPU_KVCACHE_SPACE: {kv_bytes / 2**30:.2f} GiB); lower "
                        "max_num_seqs or budget_tokens (oasiskv.vllm.sequences_that_fit)")
