"""How an OasisKVCache's forwards reach it: the attention function "oasiskv" in transformers' dispatch, the
decoder's forward hooks, and the module-level state they share.

Constructing an OasisKVCache calls ``install``: it registers the attention function "oasiskv"
(``AttentionInterface``, with ``AttentionMaskInterface`` reusing the original implementation's mask
function), switches the model to it, and puts a forward pre-hook on the model's decoder that announces
each forward carrying an OasisKVCache (``cache._begin_forward``: batch, rows, the 2-D padding mask) before
any layer runs, and a forward hook that ends it (``cache._end_forward``, also after an exception). A
layer's ``update`` appends and returns the forward's own K/V and leaves them in ``PENDING``; the attention
function that the same module calls next receives that very tensor and so finds its cache
(``cache._attend``). A forward with any other cache, or none, runs the model's original attention
implementation, unchanged. ``detach(model)`` restores the original and removes the hooks.
"""
from __future__ import annotations

import sys
import threading
import weakref

from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .. import Error
from .model_checks import decoder as _decoder

ATTENTION_NAME = "oasiskv"

# The model's original attention implementation, by id(config) (configs are not hashable): the
# attention and mask functions registered as "oasiskv" delegate to it for every forward that is not an
# OasisKV cache's. Values: (weakref to the config, implementation name).
_ORIGINALS: dict[int, tuple] = {}
PENDING = threading.local()  # .entry: (the key tensor update returned, the cache, layer index)
_REGISTERED = False


def original_name(config):
    entry = _ORIGINALS.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    return "sdpa"


def original_attention(module):
    """The attention function of the implementation the model had before "oasiskv"."""
    name = original_name(module.config)
    if name == "eager" or name not in ALL_ATTENTION_FUNCTIONS:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise Error(f"OasisKVCache: no original attention '{name}' for {type(module).__name__}")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]


def _attention(module, query, key, value, attention_mask, *args, **kwargs):
    """The "oasiskv" attention implementation: an OasisKV cache's forward, else the original one."""
    entry = getattr(PENDING, "entry", None)
    if entry is not None and entry[0] is key:
        PENDING.entry = None
        return entry[1]._attend(entry[2], module, query, key, value, attention_mask, args, kwargs)
    return original_attention(module)(module, query, key, value, attention_mask, *args, **kwargs)


def _mask(*args, config=None, **kwargs):
    """The "oasiskv" mask: the original implementation's mask function, unchanged (padding included)."""
    name = original_name(config) if config is not None else "sdpa"
    function = ALL_MASK_ATTENTION_FUNCTIONS[name] if name in ALL_MASK_ATTENTION_FUNCTIONS else \
        ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    return function(*args, config=config, **kwargs)


def _register():
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(ATTENTION_NAME, _attention)
        AttentionMaskInterface.register(ATTENTION_NAME, _mask)
        _REGISTERED = True


def install(model, decoder):
    """Registers "oasiskv", switches the model to it and hooks its decoder's forward (once a model)."""
    _register()
    config = model.config
    if config._attn_implementation != ATTENTION_NAME:
        _ORIGINALS[id(config)] = (weakref.ref(config), config._attn_implementation or "sdpa")
        model.set_attn_implementation(ATTENTION_NAME)
        for module in model.modules():  # sub-configs switched with it keep the same original
            sub = getattr(module, "config", None)
            if sub is not None and sub is not config and id(sub) not in _ORIGINALS:
                _ORIGINALS[id(sub)] = (weakref.ref(sub), original_name(config))
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
        model.set_attn_implementation(original_name(model.config))


def _forward_cache(kwargs):
    # Imported here: cache.py imports this module (install), so this one cannot import it at the top.
    from .cache import OasisKVCache

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
