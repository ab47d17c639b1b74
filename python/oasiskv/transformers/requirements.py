"""What oasiskv.transformers needs from torch and transformers: the import check that says what to
install, the tested transformers versions, and the keyword generate and forward take a cache by.

Imported first by the package (__init__.py), so that a missing or too old torch or transformers gives an
ImportError naming ``pip install oasiskv[transformers]`` before any other module imports them.
"""
from __future__ import annotations

import inspect

try:
    import torch  # noqa: F401
    import transformers as _hf
    # The names the other modules take from transformers: imported here too, so that their absence (an
    # older transformers) gives this message.
    from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: F401
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface  # noqa: F401
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface  # noqa: F401
except ImportError as error:  # pragma: no cover - the optional extra is absent
    raise ImportError(
        f"oasiskv.transformers needs torch and transformers ({error}); install them with "
        "`pip install oasiskv[transformers]`") from error

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
