"""The cache's device: Cache(config, dtype, device="cpu" | "cuda" | "cuda:N", stream=...). Without
the CUDA backend or a GPU a CUDA cache is refused saying which; every array a call takes is checked
against the cache's memory (an array of another device is refused naming the argument, before any
state changes); remainder writes into the caller's out and lse when given."""
import numpy as np
import pytest

import oasiskv
from conftest import make_config

fake = oasiskv._oasiskv._fake_device_array  # an array that says it is on a device (never read)


def test_a_cuda_cache_without_the_backend_or_a_device_is_refused_saying_which():
    assert isinstance(oasiskv.built_with_cuda(), bool) and isinstance(oasiskv.cuda_available(), bool)
    if oasiskv.cuda_available():
        pytest.skip("a GPU is present: test_gpu.py covers the CUDA cache")
    want = "no CUDA device is present" if oasiskv.built_with_cuda() else "built without the CUDA backend"
    for device in ("cuda", "cuda:0", "cuda:1"):
        with pytest.raises(oasiskv.Error, match=want):
            oasiskv.Cache(make_config(), dtype="float16", device=device)
    with pytest.raises(oasiskv.Error, match=r"device 'tpu' is not 'cpu', 'cuda' or 'cuda:N'"):
        oasiskv.Cache(make_config(), device="tpu")
    with pytest.raises(oasiskv.Error, match=r"device 'cuda:x' is not"):
        oasiskv.Cache(make_config(), device="cuda:x")
    with pytest.raises(oasiskv.Error, match=r"stream is for a CUDA cache; this one is on the cpu"):
        oasiskv.Cache(make_config(), stream=0)
    assert oasiskv.Cache(make_config()).device == "cpu"


def test_device_arrays_to_a_cpu_cache_are_refused_naming_them(rng):
    cache = oasiskv.Cache(make_config())
    cache.add_sequence(1)
    k = rng.standard_normal((40, 2, 64)).astype(np.float32)
    q = rng.standard_normal((1, 8, 64)).astype(np.float32)
    with pytest.raises(oasiskv.Error, match=r"append: k is on cuda:0; this cache \(CPU backend\) takes host arrays"):
        cache.append([1], 0, fake([40, 2, 64], "cuda:0"), k, rows_per_seq=[40])
    with pytest.raises(oasiskv.Error, match=r"append: v is on cuda:1"):
        cache.append([1], 0, k, fake([40, 2, 64], "cuda:1"), rows_per_seq=[40])
    assert cache.sequence_length(1, 0) == 0  # nothing appended
    cache.append([1], 0, k, k, rows_per_seq=[40])
    with pytest.raises(oasiskv.Error, match=r"prefetch: q_lookahead is on cuda:0"):
        cache.prefetch([1], 0, fake([1, 8, 64], "cuda:0"))
    t = cache.prefetch([1], 0, q)
    cache.acquire(t)
    with pytest.raises(oasiskv.Error, match=r"observe: q_true is on cuda:0"):
        cache.observe(t, fake([1, 8, 64], "cuda:0"))
    cache.release(t)
    assert cache.statistics().total().plans == 2  # the refused prefetch planned nothing


def test_remainder_writes_into_the_callers_arrays(rng):
    cache = oasiskv.Cache(make_config(num_layers=1, remainder="clusters"))
    cache.add_sequence(1)
    k = rng.standard_normal((600, 2, 64)).astype(np.float32)
    cache.append([1], 0, k, k, rows_per_seq=[600])
    q = rng.standard_normal((2, 8, 64)).astype(np.float32)
    t = cache.prefetch([1], 0, q)
    cache.acquire(t)
    want_out, want_lse = cache.remainder(t, q)
    out, lse = np.full((2, 8, 64), 7.0, np.float32), np.full((2, 8), 7.0, np.float32)
    got_out, got_lse = cache.remainder(t, q, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    with pytest.raises(oasiskv.Error, match=r"remainder: out has shape \(2, 8, 32\), expected \(2, 8, 64\)"):
        cache.remainder(t, q, out=np.zeros((2, 8, 32), np.float32), lse=lse)
    with pytest.raises(oasiskv.Error, match=r"remainder: lse has dtype float64, expected float32"):
        cache.remainder(t, q, out=out, lse=np.zeros((2, 8)))
    with pytest.raises(oasiskv.Error, match=r"remainder: pass both out and lse, or neither"):
        cache.remainder(t, q, out=out)
    with pytest.raises(oasiskv.Error, match=r"remainder: out is on cuda:0; this cache \(CPU backend\)"):
        cache.remainder(t, q, out=fake([2, 8, 64], "cuda:0"), lse=lse)
    cache.release(t)
