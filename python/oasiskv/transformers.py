"""OasisKV inside Hugging Face transformers: a ``transformers.Cache`` that decodes through ``oasiskv.Cache``.

    import torch, oasiskv.transformers
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.float32)
    cache = oasiskv.transformers.OasisKVCache(model, budget_tokens=1024, max_batch=1, max_tokens=8192)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

Needs torch and transformers (``pip install oasiskv[transformers]``; tested with transformers 5.17 and
5.25). The method (the paper's protocol, docs/architecture.md "The decode step as data flow"):

- The prefill (the first forward of a cache) appends the prompt's K/V (left padding never enters the
  cache), attends densely over the prompt with the model's own attention implementation (SDPA for
  most models) and plans each layer's first working set from the last query row.
- Every later forward, per layer: append the forward's rows (in ``update``), plan the next step from the
  forward's lookahead rows (the draft rows when ``prompt_lookup_num_tokens`` or an assistant model
  drafts: every row after the first; else the current row) with ``next_step_rows`` = the rows of this
  forward, then attend the ticket the previous forward planned over the resident blocks, with GQA,
  causal by token position (on the CPU ``LayerView.attention``, the module's kernel straight over the
  view's blocks; on a GPU a gather from the view's zero-copy slot pool and batched masked attention);
  release. With ``remainder`` configured, the estimate of the non-resident
  blocks is merged by log-sum-exp.
- ``crop`` is ``truncate`` plus a new plan from the surviving last row's query; beam search and
  ``num_return_sequences`` map to ``fork`` and ``remove_sequence`` with new plans from the kept queries.

How forwards are paired with the cache: constructing an OasisKVCache registers the attention function
"oasiskv" (``AttentionInterface``, with ``AttentionMaskInterface`` reusing the original implementation's
mask function), switches the model to it, and puts a forward pre-hook on the model's decoder that
announces each forward carrying an OasisKVCache (batch, rows, the 2-D padding mask) before any layer
runs. A layer's ``update`` appends and returns the forward's own K/V; the attention function that the
same module calls next receives that very tensor and so finds its cache. A forward with any other
cache, or none, runs the model's original attention implementation, unchanged.

On a GPU: a model on one CUDA device gets a CUDA ``oasiskv.Cache`` (the module built with the CUDA
backend), whose compute stream is the device's current torch stream when the OasisKVCache is made (every
forward must run on that stream). K/V and queries go to it as device tensors, the view's arrays come back
as device tensors (DLPack, zero copy) and the gather and attention over them are torch work queued on that
stream: after the prefill, nothing on the decode path waits for the device (the checks that would read a
device tensor are deferred or done on host copies; see ``_note_padding``).

One cache object serves one ``generate`` call (its sequences are that call's); ``reset()`` empties it
for the next. A call the cache cannot serve (another model, a batch above ``max_batch``, more tokens than
``max_tokens``, sliding-window or cross-attention models, right padding) raises ``oasiskv.Error`` naming
it before the cache changes.
"""
from __future__ import annotations

import inspect
import math
import sys
import threading
import weakref
from time import perf_counter as _clock


try:
    import torch
    import transformers as _hf
    from transformers.cache_utils import Cache as _HFCache
    from transformers.cache_utils import CacheLayerMixin as _HFLayer
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
except ImportError as error:  # pragma: no cover - the optional extra is absent
    raise ImportError(
        f"oasiskv.transformers needs torch and transformers ({error}); install them with "
        "`pip install oasiskv[transformers]`") from error

from . import Cache as _NativeCache
from . import CacheConfig, Error

__all__ = ["OasisKVCache", "ATTENTION_NAME", "CACHE_KWARG", "TESTED_TRANSFORMERS", "detach"]

ATTENTION_NAME = "oasiskv"
TESTED_TRANSFORMERS = (">=5.17", "<5.26")


def _version_tuple(text):
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


if _version_tuple(_hf.__version__) < (5, 17):
    raise ImportError(f"oasiskv.transformers needs transformers >= 5.17 (found {_hf.__version__}); "
                      "`pip install oasiskv[transformers]` installs a tested one")

# The keyword generate and forward take a cache by: `cache` in recent transformers (`past_key_values`
# still works there, with a FutureWarning), `past_key_values` in 5.17.
CACHE_KWARG = ("cache" if "cache" in inspect.signature(_hf.GenerationMixin.prepare_inputs_for_generation).parameters
               else "past_key_values")

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Lookahead rows a sequence a CUDA cache plans from: CudaOptions::max_query_rows, which the binding leaves
# at its default.
_CUDA_QUERY_ROWS = 4

# ---- dispatch: the attention function and its mask -------------------------------------------------

# The model's original attention implementation, by id(config) (configs are not hashable): the
# attention and mask functions registered as "oasiskv" delegate to it for every forward that is not an
# OasisKV cache's. Values: (weakref to the config, implementation name).
_ORIGINALS: dict[int, tuple] = {}
_PENDING = threading.local()  # .entry: (the key tensor update returned, the cache, layer index)
_REGISTERED = False


def _original_name(config):
    entry = _ORIGINALS.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    return "sdpa"


def _original_attention(module):
    name = _original_name(module.config)
    if name == "eager" or name not in ALL_ATTENTION_FUNCTIONS:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise Error(f"OasisKVCache: no original attention '{name}' for {type(module).__name__}")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]


def _attention(module, query, key, value, attention_mask, *args, **kwargs):
    """The "oasiskv" attention implementation: an OasisKV cache's forward, else the original one."""
    entry = getattr(_PENDING, "entry", None)
    if entry is not None and entry[0] is key:
        _PENDING.entry = None
        return entry[1]._attend(entry[2], module, query, key, value, attention_mask, args, kwargs)
    return _original_attention(module)(module, query, key, value, attention_mask, *args, **kwargs)


def _mask(*args, config=None, **kwargs):
    """The "oasiskv" mask: the original implementation's mask function, unchanged (padding included)."""
    name = _original_name(config) if config is not None else "sdpa"
    function = ALL_MASK_ATTENTION_FUNCTIONS[name] if name in ALL_MASK_ATTENTION_FUNCTIONS else \
        ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    return function(*args, config=config, **kwargs)


def _register():
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(ATTENTION_NAME, _attention)
        AttentionMaskInterface.register(ATTENTION_NAME, _mask)
        _REGISTERED = True


# ---- the model's shape and what the cache refuses ---------------------------------------------------


def _decoder(model):
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    return decoder if isinstance(decoder, torch.nn.Module) else getattr(model, "base_model", model)


def _attention_modules(model, num_layers):
    found = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "scaling") and hasattr(module, "num_key_value_groups"):
            found.setdefault(int(module.layer_idx), module)
    return [found.get(layer) for layer in range(num_layers)]


def _model_shape(model):
    """(layers, q heads, kv heads, head dim, dtype name, scaling, device) of a model the cache can serve, or
    raises oasiskv.Error naming what it cannot."""
    config = getattr(model, "config", None)
    if config is None or not isinstance(model, torch.nn.Module):
        raise Error(f"OasisKVCache: expected a transformers model, got {type(model).__name__}")
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise Error(f"OasisKVCache: {name} is an encoder-decoder model (cross-attention); only decoder-only "
                    "models with full attention are supported")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "add_cross_attention", False):
        raise Error(f"OasisKVCache: {name} has cross-attention layers (add_cross_attention=True); not supported")
    num_layers = int(text.num_hidden_layers)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise Error(f"OasisKVCache: {name} has layers of type {', '.join(other)} (layer_types); only "
                        "full-attention layers are supported (no sliding window, chunked or linear attention)")
    elif getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
        raise Error(f"OasisKVCache: {name} uses sliding-window attention (sliding_window={text.sliding_window}); "
                    "not supported")
    if getattr(text, "attention_chunk_size", None) is not None:
        raise Error(f"OasisKVCache: {name} uses chunked attention; not supported")
    q_heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or q_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // q_heads
    dtype = getattr(model, "dtype", None)
    if dtype not in _DTYPES:
        raise Error(f"OasisKVCache: {name} has dtype {dtype}; expected float32, float16 or bfloat16")
    devices = {p.device for p in model.parameters()} or {torch.device(getattr(model, "device", "cpu"))}
    if len(devices) != 1:
        raise Error(f"OasisKVCache: {name} is spread over {', '.join(sorted(str(d) for d in devices))}; the cache "
                    "serves a model on the cpu or on one CUDA device")
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise Error(f"OasisKVCache: {name} is on {device}; the cache serves a model on the cpu or on one CUDA device")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    modules = _attention_modules(model, num_layers)
    missing = [layer for layer, module in enumerate(modules) if module is None]
    if missing:
        raise Error(f"OasisKVCache: {name} has no attention module with layer_idx {missing[0]} "
                    f"(of {num_layers} layers); its attention does not follow transformers' AttentionInterface")
    scales = {float(module.scaling) for module in modules}
    if len(scales) != 1:
        raise Error(f"OasisKVCache: {name}'s layers use different softmax scales {sorted(scales)}; not supported")
    if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        raise Error(f"OasisKVCache: {name} cannot switch its attention implementation (it does not use "
                    "transformers' AttentionInterface)")
    return num_layers, q_heads, kv_heads, int(head_dim), _DTYPES[dtype], scales.pop(), device


def _install(model, decoder):
    """Registers "oasiskv", switches the model to it and hooks its decoder's forward (once a model)."""
    _register()
    config = model.config
    if config._attn_implementation != ATTENTION_NAME:
        _ORIGINALS[id(config)] = (weakref.ref(config), config._attn_implementation or "sdpa")
        model.set_attn_implementation(ATTENTION_NAME)
        for module in model.modules():  # sub-configs switched with it keep the same original
            sub = getattr(module, "config", None)
            if sub is not None and sub is not config and id(sub) not in _ORIGINALS:
                _ORIGINALS[id(sub)] = (weakref.ref(sub), _original_name(config))
    if getattr(decoder, "_oasiskv_hooks", None) is None:
        decoder._oasiskv_hooks = (
            decoder.register_forward_pre_hook(_pre_forward, with_kwargs=True),
            decoder.register_forward_hook(_post_forward, with_kwargs=True, always_call=True),
        )


def detach(model):
    """Gives `model` its original attention implementation back and removes the forward hooks."""
    decoder = _decoder(model)
    hooks = getattr(decoder, "_oasiskv_hooks", None)
    if hooks is not None:
        for hook in hooks:
            hook.remove()
        decoder._oasiskv_hooks = None
    if model.config._attn_implementation == ATTENTION_NAME:
        model.set_attn_implementation(_original_name(model.config))


def _forward_cache(kwargs):
    for name in ("cache", "past_key_values"):
        value = kwargs.get(name)
        if isinstance(value, OasisKVCache):
            return value
    return None


def _pre_forward(decoder, args, kwargs):
    cache = _forward_cache(kwargs)
    if cache is not None:
        cache._begin_forward(decoder, args, kwargs)
    return None


def _post_forward(decoder, args, kwargs, output=None):
    cache = _forward_cache(kwargs)
    if cache is not None:
        cache._end_forward()
    return None


class _Forward:
    __slots__ = ("batch", "rows", "prefill", "real", "real_rows", "appended", "layers_done")

    def __init__(self, batch, rows, prefill, real, real_rows):
        self.batch, self.rows, self.prefill = batch, rows, prefill
        self.real, self.real_rows = real, real_rows  # prefill: [B, R] bool mask, rows per sequence
        self.appended = 0  # layers whose rows were appended
        self.layers_done = 0  # layers attended


class OasisKVLayer(_HFLayer):
    """One layer of an OasisKVCache: `update` appends the forward's K/V to the OasisKV cache and returns
    them (the attention function attends over the resident set, not over these). Sequence operations
    (crop, reorder, ...) act on every layer at once: call them on the OasisKVCache."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, owner, layer_idx):
        super().__init__()
        self._owner = weakref.proxy(owner)
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._owner._update(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length, *args):
        return self._owner._seen + int(query_length), 0

    def get_seq_length(self, *args):
        return self._owner._seen

    def get_max_length(self):
        return -1

    def get_max_cache_shape(self):  # transformers <= 5.17
        return -1

    def reset(self):
        self._owner.reset()

    def _whole_cache(self, what):
        raise Error(f"OasisKVLayer.{what}: sequence operations act on every layer at once; call "
                    f"OasisKVCache.{what}")

    def crop(self, tokens_to_remove):
        self._whole_cache("crop")

    def reorder_cache(self, beam_idx):
        self._whole_cache("reorder_cache")

    def batch_repeat_interleave(self, repeats):
        self._whole_cache("batch_repeat_interleave")

    def batch_select_indices(self, indices):
        self._whole_cache("batch_select_indices")

    def offload(self):
        pass

    def prefetch(self):
        pass


class OasisKVCache(_HFCache):
    """A transformers Cache whose layers live in an ``oasiskv.Cache`` of the model's shape.

    ``OasisKVCache(model, budget_tokens=1024, max_batch=1, max_tokens=4096, **cache_config)``: the
    cache has ``model``'s layers, q / kv heads and head dim (its text config) and dtype; ``max_batch``
    sequences (a batch times ``num_return_sequences`` or ``num_beams``) of up to ``max_tokens`` tokens
    each; ``cache_config`` is any other ``oasiskv.CacheConfig`` field (``remainder="quantized"``,
    ``recent_tokens``, ...). ``softmax_scale`` is the model's attention scaling. Use it for one
    ``model.generate(..., past_key_values=cache)`` call (or a loop of forwards); ``reset()`` empties it.

    ``cache.native`` is the ``oasiskv.Cache`` (``statistics()``); ``cache.counters`` counts forwards,
    crops, rows dropped, forks, removed sequences and plans made outside a forward.

    A model on a CUDA device gets a CUDA ``oasiskv.Cache`` on that device (``cache.device``), working on
    the device's current torch stream at construction; forwards must run on that stream.
    """

    def __init__(self, model, *, budget_tokens=2048, max_batch=1, max_tokens=4096, **cache_config):
        self._model_name = type(model).__name__
        layers_n, q_heads, kv_heads, head_dim, dtype, scaling, device = _model_shape(model)
        scale = cache_config.pop("softmax_scale", None)
        if scale is not None and scale != 0 and not math.isclose(float(scale), scaling, rel_tol=1e-6):
            raise Error(f"OasisKVCache: softmax_scale={scale} differs from the model's attention scaling "
                        f"{scaling}; the remainder merge needs them equal (leave softmax_scale out)")
        self.cache_config = CacheConfig(num_layers=layers_n, num_q_heads=q_heads, num_kv_heads=kv_heads,
                                  head_dim=head_dim, budget_tokens=int(budget_tokens),
                                  max_sequences=int(max_batch), max_tokens_per_sequence=int(max_tokens),
                                  softmax_scale=float(scaling), **cache_config)
        self._device = device
        self._on_device = device.type == "cuda"
        if self._on_device:
            # The cache's compute stream is fixed now: the stream torch queues this device's work on (the
            # default one unless the caller is inside a torch.cuda.stream block); _begin_forward checks it.
            self._stream = torch.cuda.current_stream(device).cuda_stream
            try:
                self.native = _NativeCache(self.cache_config, dtype=dtype, device=f"cuda:{device.index}",
                                           stream=self._stream)
            except Error as error:
                raise Error(f"OasisKVCache: {self._model_name} is on {device}, which needs a CUDA oasiskv.Cache: "
                            f"{error}") from None
        else:
            self._stream = None
            self.native = _NativeCache(self.cache_config, dtype=dtype)
        super().__init__(layers=[OasisKVLayer(self, layer) for layer in range(layers_n)])
        self.shape = (layers_n, q_heads, kv_heads, head_dim)
        self.dtype = dtype
        self.scaling = scaling
        self.max_batch, self.max_tokens = int(max_batch), int(max_tokens)
        self._remainder = self.cache_config.remainder != "none"
        self._block_tokens = self.cache_config.block_tokens
        self._max_rows = max(1, self.cache_config.recent_tokens)  # rows a later forward may bring
        decoder = _decoder(model)
        self._decoder = weakref.ref(decoder)
        self._next_id = 1
        self.counters = {}
        # Seconds spent per part of the decode path after the prefill (append, plan, acquire, gather (GPU),
        # attention, remainder, release), accumulated while `timings` is a dict:
        # `cache.timings = cache.new_timings()`.
        # On CUDA the parts are the host's time to queue their work (nothing waits for the device).
        self.timings = None
        self._arange_cache = {}
        self._clear()
        _install(model, decoder)

    # ---- state ----------------------------------------------------------------------------------

    def _clear(self):
        layers = len(self.layers)
        self._seq_ids = []
        self._pad = torch.zeros(0, dtype=torch.long)  # left-padding columns per sequence
        self._seen = 0  # columns transformers has seen (padding included): its sequence length
        self._tickets = [None] * layers  # (ticket, next_step_rows it was planned for)
        self._plan_q = [None] * layers  # the lookahead rows of that plan [B * R][q heads][d]
        self._last_q = [None] * layers  # the last forward's queries [B][q heads][R][d]
        self._replanned = [False] * layers  # planned between forwards (crop, batch operations)
        self._rows_hint = 1
        self._forward = None
        self._broken = None
        # New flags for the next call: a copy still in flight writes the old pinned one, which no one reads
        # (torch's pinned-memory cache keeps it until that copy is done).
        self._padding_flags = None
        self.counters.update(forwards=0, prefills=0, draft_rows=0, crops=0, rows_dropped=0, forks=0,
                             removed=0, replans=0, row_fixups=0)

    def reset(self):
        """Removes every sequence: the cache serves a new generate call (statistics are kept)."""
        for seq in self._seq_ids:
            if self.native.has_sequence(seq):
                self.native.remove_sequence(seq)
        self._clear()

    @property
    def device(self):
        """The model's device (torch.device): "cpu", or the CUDA device the cache's slots live on."""
        return self._device

    @staticmethod
    def new_timings():
        return dict.fromkeys(("append", "plan", "acquire", "gather", "attention", "remainder", "release"), 0.0)

    @property
    def batch_size(self):
        return len(self._seq_ids) if self._seq_ids else -1

    @property
    def sequence_ids(self):
        """The oasiskv sequence ids of the batch, in batch order."""
        return list(self._seq_ids)

    def sequence_lengths(self):
        """Tokens each sequence of the batch holds (padding excluded)."""
        return [self._seen - int(p) for p in self._pad]

    def statistics(self):
        return self.native.statistics()

    def __repr__(self):
        if not hasattr(self, "_seq_ids"):
            return f"OasisKVCache({self._model_name}, not constructed)"
        return (f"OasisKVCache({self._model_name}, layers={self.shape[0]}, batch={len(self._seq_ids)}, "
                f"seen={self._seen}, budget_tokens={self.cache_config.budget_tokens}, "
                f"remainder={self.cache_config.remainder!r})")

    # ---- one forward: announced by the decoder's pre-hook, then update + attention per layer ---------

    def _begin_forward(self, decoder, args, kwargs):
        if decoder is not self._decoder():
            raise Error(f"OasisKVCache: built for a {self._model_name} of shape (layers, q heads, kv heads, head dim)"
                        f" = {self.shape}, called from another model ({type(decoder).__name__} with "
                        f"{self._describe(decoder)}); a cache serves the model it was built for")
        if self._broken is not None:
            raise Error(f"OasisKVCache: {self._broken}; call reset() before using it again")
        self._check_stream("a forward")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            raise Error("OasisKVCache: a forward without input_ids or inputs_embeds")
        batch, rows = int(ids.shape[0]), int(ids.shape[1])
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict) or (mask is not None and mask.dim() != 2):
            raise Error("OasisKVCache: the forward carries a prepared (4-D or per-layer) attention mask; pass the "
                        "2-D padding mask")
        prefill = not self._seq_ids
        if not prefill and batch != len(self._seq_ids):
            raise Error(f"OasisKVCache: a forward of batch {batch}, the cache holds {len(self._seq_ids)} sequences "
                        "(one cache serves one generate call: reset() it for another)")
        if mask is not None and tuple(mask.shape) != (batch, self._seen + rows):
            raise Error(f"OasisKVCache: attention_mask has shape {tuple(mask.shape)}, expected "
                        f"({batch}, {self._seen + rows}) (the cache holds {self._seen} columns, the forward {rows})")
        if prefill:
            if batch > self.max_batch:
                raise Error(f"OasisKVCache: a batch of {batch} sequences, above max_batch={self.max_batch} "
                            "(num_return_sequences and num_beams multiply the batch)")
            if mask is None:
                real = None
                real_rows = [rows] * batch
            else:
                # The prefill reads the mask on the host (rows per sequence are host arguments of append):
                # on a GPU these are the cache's only waits for the device, once a generate call.
                real = mask.to(torch.bool)
                if rows > 1 and bool((real[:, 1:].int() < real[:, :-1].int()).any()):
                    raise Error("OasisKVCache: the attention mask has padding after a token (right or inner "
                                "padding); only left padding is supported (tokenizer.padding_side='left')")
                real_rows = real.sum(dim=1).tolist()
                if min(real_rows) == 0:
                    raise Error("OasisKVCache: a sequence of the batch is all padding")
            if max(real_rows) > self.max_tokens:
                raise Error(f"OasisKVCache: a prompt of {max(real_rows)} tokens, above max_tokens={self.max_tokens}")
            self._forward = _Forward(batch, rows, True, real, real_rows)
            return
        if rows > self._max_rows:
            raise Error(f"OasisKVCache: a forward of {rows} rows after the prefill, above recent_tokens="
                        f"{self._max_rows} (the view holds a forward's own rows in its recent ring); one cache serves "
                        "one generate call: reset() it for another")
        if mask is not None:
            if mask.device.type == "cpu":
                if not bool(mask[:, -rows:].to(torch.bool).all()):
                    raise Error("OasisKVCache: padding in the rows of a forward after the prefill; not supported")
            else:
                self._note_padding(mask[:, -rows:])
        longest = self._seen + rows - int(self._pad.min())
        if longest > self.max_tokens:
            raise Error(f"OasisKVCache: {longest} tokens in a sequence, above max_tokens={self.max_tokens}")
        self._forward = _Forward(batch, rows, False, None, [rows] * batch)

    def _check_stream(self, what):
        """A CUDA cache orders its work on the stream it was made with: torch work on another stream would
        race with its copies."""
        if self._on_device:
            current = torch.cuda.current_stream(self._device).cuda_stream
            if current != self._stream:
                raise Error(f"OasisKVCache: {what} on CUDA stream {current:#x}; the cache was made on stream "
                            f"{self._stream:#x} of {self._device} (make the cache inside the same "
                            "torch.cuda.stream block as the forwards)")

    def _note_padding(self, rows_mask):
        """The padding check of a decode forward's rows on a device mask, without waiting for the device:
        the forward ORs "a row was padding" into a device flag and queues its copy to pinned host memory;
        the next forward reads that host copy (no synchronisation; a copy not landed yet is read later). A
        padded row is therefore refused one forward or more after it entered the cache, which then refuses
        until reset() (a CPU mask is checked at once, before the cache changes)."""
        if self._padding_flags is None:
            self._padding_flags = (torch.zeros((), dtype=torch.bool, device=self._device),
                                   torch.zeros((), dtype=torch.bool, pin_memory=True))
        on_device, on_host = self._padding_flags
        if bool(on_host):  # pinned host memory: a plain read
            self._broken = "a forward after the prefill had padding in its rows (not supported)"
            raise Error(f"OasisKVCache: {self._broken}; seen from the host copy of the device mask, after that "
                        "forward ran; call reset()")
        on_device.logical_or_(~rows_mask.to(torch.bool).all())
        on_host.copy_(on_device, non_blocking=True)

    def _describe(self, decoder):
        config = getattr(decoder, "config", None)
        if config is None:
            return "an unknown shape"
        try:
            q = config.num_attention_heads
            shape = (config.num_hidden_layers, q, getattr(config, "num_key_value_heads", None) or q,
                     getattr(config, "head_dim", None) or config.hidden_size // q)
        except AttributeError:
            return "an unknown shape"
        return f"shape {shape}"

    def _end_forward(self):
        forward, self._forward = self._forward, None
        _PENDING.entry = None
        if forward is None:
            return
        if forward.appended == 0:
            return  # refused before any change
        if forward.layers_done != len(self.layers):
            self._broken = (f"a forward stopped after {forward.layers_done} of {len(self.layers)} layers "
                            "(an exception inside the model)")
            return
        self._seen += forward.rows
        self.counters["forwards"] += 1
        if forward.prefill:
            self.counters["prefills"] += 1
        elif forward.rows > 1:
            self.counters["draft_rows"] += forward.batch * (forward.rows - 1)
            self._rows_hint = max(self._rows_hint, forward.rows)

    def _update(self, layer, key_states, value_states):
        forward = self._forward
        if forward is None:
            raise Error(f"OasisKVCache: update of layer {layer} outside a forward of the {self._model_name} the "
                        "cache was built for (another model, or its decoder's forward hook was removed)")
        batch, kv_heads, rows, head_dim = key_states.shape
        if (batch, rows) != (forward.batch, forward.rows) or (kv_heads, head_dim) != self.shape[2:]:
            raise Error(f"OasisKVCache: layer {layer} got K of shape {tuple(key_states.shape)}, expected "
                        f"({forward.batch}, {self.shape[2]}, {forward.rows}, {self.shape[3]})")
        if layer != forward.appended or forward.appended != forward.layers_done:
            raise Error(f"OasisKVCache: layer {layer} updated out of order (expected layer {forward.layers_done})")
        first = forward.prefill and layer == 0
        if first:
            ids = list(range(self._next_id, self._next_id + batch))
            for seq in ids:
                self.native.add_sequence(seq)
            self._seq_ids = ids
        k = key_states.transpose(1, 2)  # [B][R][kv heads][d]
        v = value_states.transpose(1, 2)
        if forward.real is not None:
            k, v = k[forward.real], v[forward.real]  # left padding never enters the cache (prefill only)
        else:
            k, v = k.reshape(batch * rows, kv_heads, head_dim), v.reshape(batch * rows, kv_heads, head_dim)
        timings = None if forward.prefill else self.timings  # the decode path's parts
        if timings is not None:
            started = _clock()
        try:
            self.native.append(self._seq_ids, layer, k.contiguous(), v.contiguous(), rows_per_seq=forward.real_rows)
        except Exception:
            if first:  # refused: the cache stays as it was
                for seq in self._seq_ids:
                    self.native.remove_sequence(seq)
                self._seq_ids = []
            raise
        if first:
            self._next_id += batch
            self._pad = torch.tensor([rows - n for n in forward.real_rows], dtype=torch.long)
        if timings is not None:
            timings["append"] += _clock() - started
        forward.appended += 1
        _PENDING.entry = (key_states, self, layer)
        return key_states, value_states

    def _attend(self, layer, module, query, key, value, attention_mask, args, kwargs):
        forward = self._forward
        scaling = kwargs.get("scaling")
        if scaling is not None and not math.isclose(float(scaling), self.scaling, rel_tol=1e-6):
            raise Error(f"OasisKVCache: layer {layer} attends at scaling {scaling}, the cache's softmax scale is "
                        f"{self.scaling}")
        batch, q_heads, rows, head_dim = query.shape
        if forward.prefill:
            # Dense over the prompt's own K/V (key, value: this forward's rows, the model's causal mask).
            out = _original_attention(module)(module, query, key, value, attention_mask, *args, **kwargs)
            self._plan(layer, query, rows_from=rows - 1, next_step_rows=self._rows_hint)
            forward.layers_done += 1
            return out
        timings = self.timings
        ticket, planned = self._tickets[layer]
        if rows > planned:  # the plan left blocks that now leave the recent ring out: plan again
            ticket = self.native.prefetch(self._seq_ids, layer, self._plan_q[layer], next_step_rows=1)
            self.counters["row_fixups"] += 1
        # A CUDA cache holds at most two live tickets a layer (CudaOptions.tickets_per_layer). Where this
        # ticket is not the only one (planned again above, or by crop / a batch operation while the previous
        # plan was live), acquiring it first supersedes the older one before the next plan is made.
        early = self._on_device and (rows > planned or self._replanned[layer])
        acquired = False
        try:
            if early:
                view = self._acquire(ticket)
                acquired = True
            self._plan(layer, query, rows_from=1 if rows > 1 else 0, next_step_rows=max(rows, self._rows_hint))
            if not acquired:
                view = self._acquire(ticket)
                acquired = True
            out, lse = self._view_attention(view, query, rows, self._remainder)
            if self._remainder:
                if timings is not None:
                    started = _clock()
                out = _merge(out, lse, *self._remainder_state(ticket, query))
                if timings is not None:
                    timings["remainder"] += _clock() - started
        finally:
            if acquired:
                if timings is not None:
                    started = _clock()
                self.native.release(ticket)
                if timings is not None:
                    timings["release"] += _clock() - started
        forward.layers_done += 1
        return out.to(query.dtype), None

    def _acquire(self, ticket):
        timings = self.timings
        if timings is not None:
            started = _clock()
        view = self.native.acquire(ticket)
        if timings is not None:
            timings["acquire"] += _clock() - started
        return view

    def _remainder_state(self, ticket, query):
        """The cache's estimate of the blocks the view leaves out: (out [B][R][q heads][d], lse [B][R][q heads]),
        float32. A CUDA cache writes it into device tensors made here, in stream order (no copy to the host)."""
        batch, q_heads, rows, head_dim = query.shape
        q_rows = query.transpose(1, 2).reshape(batch * rows, q_heads, head_dim).contiguous()
        if self._on_device:
            rest = torch.empty(batch * rows, q_heads, head_dim, dtype=torch.float32, device=query.device)
            rest_lse = torch.empty(batch * rows, q_heads, dtype=torch.float32, device=query.device)
            self.native.remainder(ticket, q_rows, rest, rest_lse)
        else:
            rest, rest_lse = self.native.remainder(ticket, q_rows)
            rest, rest_lse = torch.from_numpy(rest), torch.from_numpy(rest_lse)
        return rest.view(batch, rows, q_heads, head_dim), rest_lse.view(batch, rows, q_heads)

    def _plan(self, layer, query, rows_from, next_step_rows):
        """Plans the next step of `layer` from query rows [rows_from:] ([B][q heads][R][d])."""
        timings = None if self._forward is not None and self._forward.prefill else self.timings
        if timings is not None:
            started = _clock()
        batch, q_heads, _, head_dim = query.shape
        lookahead = query[:, :, rows_from:, :].transpose(1, 2).reshape(-1, q_heads, head_dim).contiguous()
        if self._on_device and lookahead.shape[0] > batch * _CUDA_QUERY_ROWS:
            # A CUDA cache takes at most CudaOptions.max_query_rows lookahead rows a sequence (scratch sized
            # at construction): the drafts nearest to the current row plan the step.
            lookahead = query[:, :, rows_from:rows_from + _CUDA_QUERY_ROWS, :].transpose(1, 2)
            lookahead = lookahead.reshape(-1, q_heads, head_dim).contiguous()
        self._tickets[layer] = (self.native.prefetch(self._seq_ids, layer, lookahead, next_step_rows=next_step_rows),
                                next_step_rows)
        self._replanned[layer] = self._forward is None  # crop or a batch operation, between forwards
        if timings is not None:
            timings["plan"] += _clock() - started
        self._plan_q[layer] = lookahead
        self._last_q[layer] = query

    def _aranges(self, n, device):
        """(arange(n)[None, :], arange(block_tokens)) on `device`, made once per (n, device)."""
        pair = self._arange_cache.get((n, device))
        if pair is None:
            pair = self._arange_cache[(n, device)] = (torch.arange(n, device=device)[None, :],
                                                      torch.arange(self._block_tokens, device=device))
        return pair

    def _view_attention(self, view, query, rows, want_lse):
        """Attention of the forward's rows over the view, causal by position (row r of a sequence of n tokens
        sits at n - rows + r), with GQA. On the CPU: LayerView.attention, the module's kernel straight over the
        view's blocks (no copy of the resident rows, one call a layer, on the calling thread). Returns out
        [B][R][q heads][d] and lse [B][R][q heads] (None without want_lse), float32."""
        if self._on_device:
            return self._device_view_attention(view, query, rows, want_lse)
        timings = self.timings
        if timings is not None:
            started = _clock()
        batch, q_heads, _, head_dim = query.shape
        q = query.transpose(1, 2).reshape(batch * rows, q_heads, head_dim).to(torch.float32).contiguous()
        out = torch.empty(batch * rows, q_heads, head_dim, dtype=torch.float32)
        lse = torch.empty(batch * rows, q_heads, dtype=torch.float32)
        view.attention(q, self.scaling, out=out, lse=lse)
        if timings is not None:
            timings["attention"] += _clock() - started
        return out.view(batch, rows, q_heads, head_dim), lse.view(batch, rows, q_heads) if want_lse else None

    def _device_view_attention(self, view, query, rows, want_lse):
        """_view_attention over a CUDA cache's view: one gather of the resident rows of every (sequence, kv
        head) pair from the view's zero-copy slot pool, then one masked SDPA, from the view's device arrays
        (zero copy), all of it torch work queued on the cache's stream; nothing is read on the host. Each pair is padded to the view's room per pair (the largest head budget: len(slot) / pairs)
        rather than to its longest pair, which the host cannot know without waiting for the device. Entries
        past a pair's own (the next pair's, or past the view's last entry: undefined contents) are masked
        and read slot 0. The query heads of a kv head are folded into the query rows (one kv head per pair),
        so SDPA needs no GQA support from its fused kernels."""
        timings = self.timings
        if timings is not None:
            started = _clock()
        batch, q_heads, _, head_dim = query.shape
        kv_heads = self.shape[2]
        group = q_heads // kv_heads
        bt = self._block_tokens
        pairs = batch * kv_heads
        device = query.device
        indptr = _from_dlpack(view.indptr).long()
        slot = _from_dlpack(view.slot)  # int32 [pairs * room], of which indptr[-1] are the view's
        valid = _from_dlpack(view.valid_tokens)
        capacity = slot.shape[0]
        width = capacity // pairs
        j, offset = self._aranges(width, device)
        start, count = indptr[:-1, None], (indptr[1:] - indptr[:-1])[:, None]
        unused = j >= count  # [P][NB]: padding entries
        entry = (start + j).clamp_(max=capacity - 1)
        slots = slot[entry].masked_fill_(unused, 0).view(-1)
        pool = _from_dlpack(view.pool)  # [slots][K|V][block_tokens][d], the cache's dtype (bfloat16 included)
        keys = pool[:, 0].index_select(0, slots).view(pairs, 1, width * bt, head_dim)
        values = pool[:, 1].index_select(0, slots).view(pairs, 1, width * bt, head_dim)
        if timings is not None:
            now = _clock()
            timings["gather"] += now - started
            started = now
        tokens = valid[entry].masked_fill_(unused, 0)
        key_ok = (offset < tokens[:, :, None]).view(pairs, 1, 1, -1)
        if rows > 1:  # causal by position, as on the CPU path
            block = _from_dlpack(view.block)[entry].long()
            seq_len = _from_dlpack(view.seq_len).long()
            position = (block[:, :, None] * bt + offset).view(pairs, 1, 1, -1)
            row_pos = (seq_len[:, None] - rows + self._aranges(rows, device)[0]).repeat_interleave(kv_heads, dim=0)
            key_ok = key_ok & (position <= row_pos.view(pairs, 1, rows, 1))
            key_ok = key_ok.expand(pairs, group, rows, -1).reshape(pairs, 1, group * rows, -1)
        q = query.reshape(pairs, 1, group * rows, head_dim)  # query heads h * group + g use kv head h
        compute = torch.float32 if want_lse or keys.dtype != query.dtype else query.dtype
        if keys.dtype != compute or q.dtype != compute:
            q, keys, values = q.to(compute), keys.to(compute), values.to(compute)
        if not want_lse:
            out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=key_ok,
                                                                   scale=self.scaling)
            lse = None
        else:
            scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scaling).masked_fill_(~key_ok, float("-inf"))
            lse = torch.logsumexp(scores, dim=-1)  # [P][1][G * R]
            out = torch.matmul(torch.exp_(scores.sub_(lse[..., None])), values)
            lse = lse.view(batch, q_heads, rows).transpose(1, 2)
        out = out.view(batch, q_heads, rows, head_dim).transpose(1, 2)
        if timings is not None:
            timings["attention"] += _clock() - started
        return out, lse

    # ---- sequence operations ------------------------------------------------------------------------

    def _require_idle(self, what):
        if self._forward is not None:
            raise Error(f"OasisKVCache.{what}: called during a forward")
        if self._broken is not None:
            raise Error(f"OasisKVCache.{what}: {self._broken}; call reset()")
        self._check_stream(what)

    def crop(self, tokens_to_remove):
        """Drops rows from the end of every sequence: a negative count (transformers >= 5.18) or an
        absolute length (<= 5.17); then plans every layer again from the surviving last row's query."""
        self._require_idle("crop")
        n = int(tokens_to_remove)
        if not self._seq_ids or n == 0:
            return
        drop = -n if n < 0 else max(0, self._seen - n)
        if drop == 0:
            return
        shortest = min(self.sequence_lengths())
        if drop >= shortest:
            raise Error(f"OasisKVCache.crop({n}): would drop {drop} rows of a sequence of {shortest} tokens "
                        "(at least one must stay)")
        for seq, length in zip(self._seq_ids, self.sequence_lengths()):
            self.native.truncate(seq, length - drop)
        self._seen -= drop
        for layer in range(len(self.layers)):
            last = self._last_q[layer]
            keep = max(1, last.shape[2] - drop)  # a crop past the last forward plans from its first row
            self._last_q[layer] = last[:, :, :keep]
            self._plan(layer, self._last_q[layer], rows_from=keep - 1, next_step_rows=self._rows_hint)
        self.counters["crops"] += 1
        self.counters["rows_dropped"] += drop * len(self._seq_ids)

    def reorder_cache(self, beam_idx):
        """Beam search: sequence i becomes the old sequence beam_idx[i] (fork and remove)."""
        self._select(beam_idx, "reorder_cache")

    def batch_select_indices(self, indices):
        """Keeps the sequences at `indices` (in that order)."""
        self._select(indices, "batch_select_indices")

    def batch_repeat_interleave(self, repeats):
        """Each sequence `repeats` times in a row (forks sharing its blocks)."""
        repeats = int(repeats)
        if repeats < 1:
            raise Error(f"OasisKVCache.batch_repeat_interleave: repeats must be >= 1, got {repeats}")
        self._select([i for i in range(len(self._seq_ids)) for _ in range(repeats)], "batch_repeat_interleave")

    def _select(self, indices, what):
        self._require_idle(what)
        if isinstance(indices, torch.Tensor):
            # Forks and removals are host calls: a device tensor of indices (beam search's) is read here,
            # which waits for the device; beam search itself reads its scores on the host every step too.
            if indices.dtype == torch.bool:
                indices = indices.nonzero().flatten()
            indices = indices.tolist()
        indices = [int(i) for i in indices]
        old = len(self._seq_ids)
        if not self._seq_ids:
            if indices:
                raise Error(f"OasisKVCache.{what}: the cache holds no sequence")
            return
        if not indices:
            raise Error(f"OasisKVCache.{what}: no sequence selected")
        bad = [i for i in indices if not 0 <= i < old]
        if bad:
            raise Error(f"OasisKVCache.{what}: index {bad[0]} outside the batch of {old} sequences")
        if len(indices) > self.max_batch:
            raise Error(f"OasisKVCache.{what}: {len(indices)} sequences, above max_batch={self.max_batch}")
        if indices == list(range(old)):
            return
        used = set(indices)
        for i, seq in enumerate(self._seq_ids):  # first free what no one keeps: forks then fit max_batch
            if i not in used:
                self.native.remove_sequence(seq)
                self.counters["removed"] += 1
        taken, ids = set(), []
        for i in indices:
            if i in taken:
                seq = self._next_id
                self._next_id += 1
                self.native.fork(self._seq_ids[i], seq)
                self.counters["forks"] += 1
            else:
                taken.add(i)
                seq = self._seq_ids[i]
            ids.append(seq)
        self._seq_ids = ids
        index = torch.tensor(indices, dtype=torch.long)
        self._pad = self._pad[index]
        for layer in range(len(self.layers)):  # new plans for the new batch from the kept queries
            self._last_q[layer] = self._last_q[layer][index]
            self._plan(layer, self._last_q[layer], rows_from=self._last_q[layer].shape[2] - 1,
                       next_step_rows=self._rows_hint)
            self.counters["replans"] += 1


def _from_dlpack(array):
    """A torch tensor over a CUDA view's array, without a copy. torch.from_dlpack hands the producer its
    current stream, which is the cache's; a producer whose __dlpack__ takes no arguments gives its plain
    capsule (the view's arrays are already ordered on that stream)."""
    try:
        return torch.from_dlpack(array)
    except TypeError:
        return torch.from_dlpack(array.__dlpack__())


def _merge(out, lse, rest, rest_lse):
    """merge_state: (e^lse out + e^rest_lse rest) / (e^lse + e^rest_lse), with lse from logaddexp."""
    total = torch.logaddexp(lse, rest_lse)
    return out * torch.exp(lse - total)[..., None] + rest * torch.exp(rest_lse - total)[..., None]
