import os
import sys

import numpy as np
import pytest

import oasiskv

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def make_config(**overrides):
    fields = dict(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64, budget_tokens=256, max_sequences=4,
                  max_tokens_per_sequence=4096)
    fields.update(overrides)
    return oasiskv.CacheConfig(**fields)


@pytest.fixture
def config():
    return make_config()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


class DLPackOnly:
    """An object that only speaks DLPack (as torch / cupy tensors do to a consumer)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()
