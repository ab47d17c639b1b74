"""OasisKVCache, the ``transformers.Cache`` over an ``oasiskv.Cache``, and OasisKVLayer, its layer adapter.

The cache owns the state: the oasiskv.Cache of the model's shape (a CUDA one for a model on a CUDA
device), the batch's sequence ids and left padding, each layer's live ticket and last queries, counters
and timings. What a forward does with it is the decode protocol (protocol.py); what transformers does
between forwards (crop, beam reorder, batch selection) is sequence_operations.py; the attention over a
view is attention.py; how forwards find the cache is dispatch.py, installed by the constructor.
"""
from __future__ import annotations

import math
import weakref

import torch
from transformers.cache_utils import Cache as _HFCache
from transformers.cache_utils import CacheLayerMixin as _HFLayer

from .. import Cache as _NativeCache
from .. import CacheConfig, Error
from .attention import ViewAttention
from .dispatch import install
from .model_checks import decoder as _decoder
from .model_checks import model_shape
from .protocol import DecodeProtocol
from .sequence_operations import SequenceOperations
from .timing import DecodeTimer


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


class OasisKVCache(DecodeProtocol, SequenceOperations, _HFCache):
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
        layers_n, q_heads, kv_heads, head_dim, dtype, scaling, device = model_shape(model)
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
            # Planning and LayerView.attention on as many threads as torch's CPU kernels (OpenMP's team).
            self.native = _NativeCache(self.cache_config, dtype=dtype, threads=max(1, torch.get_num_threads()))
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
        self._timer = DecodeTimer()
        self._view_attention = ViewAttention(self.native, scaling=scaling, kv_heads=kv_heads,
                                             block_tokens=self._block_tokens, on_device=self._on_device,
                                             remainder=self._remainder, timer=self._timer)
        self._clear()
        install(model, decoder)

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

    @property
    def timings(self):
        """Seconds spent per part of the decode path after the prefill (append, plan, acquire, gather (GPU),
        attention, remainder, release), accumulated while this is a dict: ``cache.timings =
        cache.new_timings()``; None (the default) times nothing. On CUDA the parts are the host's time to
        queue their work (nothing waits for the device). timing.py has the details."""
        return self._timer.timings

    @timings.setter
    def timings(self, value):
        self._timer.timings = value

    @staticmethod
    def new_timings():
        return DecodeTimer.new_timings()

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
