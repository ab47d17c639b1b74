"""The model an OasisKVCache serves: its shape, and what the cache refuses before anything changes.

``model_shape(model)`` reads a transformers model's text config and modules and returns (layers,
q heads, kv heads, head dim, dtype name, softmax scaling, device), or raises ``oasiskv.Error`` naming
what the cache cannot serve: encoder-decoder or cross-attention models; sliding-window, chunked or
linear attention layers; a dtype other than float32, float16, bfloat16; a model spread over devices or
on one other than the cpu or a CUDA device; layers without an AttentionInterface attention module;
layers with different softmax scales. ``decoder(model)`` is the module whose forward the dispatch
hooks (dispatch.py).
"""
from __future__ import annotations

import torch

from .. import Error

# The torch dtypes the cache stores, by the name oasiskv.Cache takes.
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def decoder(model):
    """The model's decoder (``get_decoder()``), else its base model, else the model itself."""
    get = getattr(model, "get_decoder", None)
    found = get() if callable(get) else None
    return found if isinstance(found, torch.nn.Module) else getattr(model, "base_model", model)


def attention_modules(model, num_layers):
    """The attention module of each layer (None where no module has that layer_idx)."""
    found = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "scaling") and hasattr(module, "num_key_value_groups"):
            found.setdefault(int(module.layer_idx), module)
    return [found.get(layer) for layer in range(num_layers)]


def model_shape(model):
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
    if dtype not in DTYPES:
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
    modules = attention_modules(model, num_layers)
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
    return num_layers, q_heads, kv_heads, int(head_dim), DTYPES[dtype], scales.pop(), device


def describe(decoder_module):
    """A decoder's shape (layers, q heads, kv heads, head dim) from its config, for error messages."""
    config = getattr(decoder_module, "config", None)
    if config is None:
        return "an unknown shape"
    try:
        q = config.num_attention_heads
        shape = (config.num_hidden_layers, q, getattr(config, "num_key_value_heads", None) or q,
                 getattr(config, "head_dim", None) or config.hidden_size // q)
    except AttributeError:
        return "an unknown shape"
    return f"shape {shape}"
