"""Reference counting: views and their arrays keep the cache alive, deleting the cache while a view
lives is safe, released views refuse access, and calls from several threads are serialised."""
import gc
import threading
import weakref

import numpy as np
import pytest

import oasiskv
from conftest import make_config


def filled_cache(rng, n=100):
    cache = oasiskv.Cache(make_config())
    cache.add_sequence(1)
    k = rng.standard_normal((n, 2, 64)).astype(np.float32)
    cache.append([1], 0, k, k, rows_per_seq=[n])
    return cache, k


def test_arrays_keep_the_cache_alive(rng):
    cache, k = filled_cache(rng)
    t = cache.prefetch([1], 0, rng.standard_normal((1, 8, 64)).astype(np.float32))
    view = cache.acquire(t)
    pool, keys0, indptr = view.pool, view.keys(0), view.indptr
    alive = weakref.ref(cache)
    cache.release(t)
    del cache, view
    gc.collect()
    assert alive() is not None  # the pool's arrays hold it
    np.testing.assert_array_equal(keys0, k[:16, 0])  # memory still there (released: may be reused)
    assert pool.shape[1:] == (2, 16, 64) and indptr[0] == 0
    del pool, keys0
    gc.collect()
    assert alive() is not None  # indptr's owner is the view object, which holds the cache
    del indptr
    gc.collect()
    assert alive() is None  # nothing holds it any more


def test_deleting_the_cache_while_a_view_lives_is_safe(rng):
    cache, k = filled_cache(rng)
    t = cache.prefetch([1], 0, rng.standard_normal((1, 8, 64)).astype(np.float32))
    view = cache.acquire(t)
    alive = weakref.ref(cache)
    del cache
    gc.collect()
    assert alive() is not None and view.valid  # still acquired: the view works
    np.testing.assert_array_equal(view.keys(0), k[:16, 0])
    del view
    gc.collect()
    assert alive() is None  # freed with its ticket still acquired: no crash


def test_released_view_refuses_every_attribute(rng):
    cache, _ = filled_cache(rng)
    t = cache.prefetch([1], 0, rng.standard_normal((1, 8, 64)).astype(np.float32))
    view = cache.acquire(t)
    cache.release(t)
    for name in ["layer", "batch_size", "num_kv_heads", "head_dim", "block_tokens", "num_pairs", "seq_ids", "seq_len",
                 "indptr", "slot", "block", "valid_tokens", "pool"]:
        with pytest.raises(oasiskv.Error, match="released"):
            getattr(view, name)
    with pytest.raises(oasiskv.Error, match="released"):
        view.keys(0)
    with pytest.raises(oasiskv.Error, match="released"):
        view.values(0)
    assert "released" in repr(view)
    # A later acquire at the same layer does not revive the old view.
    t2 = cache.prefetch([1], 0, rng.standard_normal((1, 8, 64)).astype(np.float32))
    view2 = cache.acquire(t2)
    assert view2.valid and not view.valid
    cache.release(t2)


def test_threads_driving_caches_concurrently(rng):
    errors = []

    def drive(seed, shared):
        try:
            r = np.random.default_rng(seed)
            cache = oasiskv.Cache(make_config(num_layers=1, budget_tokens=128))
            cache.add_sequence(1)
            k = r.standard_normal((200, 2, 64)).astype(np.float32)
            cache.append([1], 0, k, k, rows_per_seq=[200])
            t = cache.prefetch([1], 0, r.standard_normal((1, 8, 64)).astype(np.float32))
            for step in range(30):
                row = r.standard_normal((1, 2, 64)).astype(np.float32)
                cache.append([1], 0, row, row)
                nxt = cache.prefetch([1], 0, r.standard_normal((1, 8, 64)).astype(np.float32))
                n = cache.attend(t, lambda view: int(view.valid_tokens.sum()))
                assert n > 0
                t = nxt
                shared.statistics()  # another cache, used by every thread
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    shared, _ = filled_cache(rng)
    threads = [threading.Thread(target=drive, args=(s, shared)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
