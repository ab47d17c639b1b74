"""The Python API: names follow the C++ Cache, every CacheConfig field is a keyword, bad input
raises oasiskv.Error naming the value, and nothing crashes."""
import re

import numpy as np
import pytest

import oasiskv
from conftest import REPO, DLPackOnly, make_config


def rows(rng, n, heads=2, d=64, dtype=np.float32):
    return rng.standard_normal((n, heads, d)).astype(dtype)


def test_version_is_the_libraries():
    text = open(f"{REPO}/CMakeLists.txt").read()
    version = re.search(r"project\(oasiskv\s+VERSION\s+([0-9.]+)", text).group(1)
    assert oasiskv.__version__ == version
    assert f"{oasiskv.version_major}.{oasiskv.version_minor}.{oasiskv.version_patch}" == version


def test_config_keywords_round_trip():
    c = oasiskv.CacheConfig(num_layers=3, num_q_heads=8, num_kv_heads=4, head_dim=32, block_tokens=8,
                            budget_tokens=128, sink_tokens=8, recent_tokens=16, fetch_ratio=0.25, max_sequences=5,
                            max_tokens_per_sequence=1000, host_pool_blocks=700, reduction="softmax_sum",
                            softmax_scale=0.5)
    assert (c.num_layers, c.num_q_heads, c.num_kv_heads, c.head_dim) == (3, 8, 4, 32)
    assert (c.block_tokens, c.budget_tokens, c.sink_tokens, c.recent_tokens) == (8, 128, 8, 16)
    assert (c.fetch_ratio, c.max_sequences, c.max_tokens_per_sequence, c.host_pool_blocks) == (0.25, 5, 1000, 700)
    assert (c.reduction, c.softmax_scale) == ("softmax_sum", 0.5)
    c.validate()
    cache = oasiskv.Cache(c)
    assert cache.config.reduction == "softmax_sum" and cache.config.budget_tokens == 128
    assert "budget_tokens=128" in repr(c)
    # Defaults are the C++ ones.
    d = oasiskv.CacheConfig()
    assert (d.block_tokens, d.budget_tokens, d.sink_tokens, d.recent_tokens, d.fetch_ratio, d.reduction) == (
        16, 2048, 16, 64, 1.0, "sum")
    with pytest.raises(TypeError):
        oasiskv.CacheConfig(2, 8)  # keywords only


def test_bad_configs_raise_error_naming_the_value():
    with pytest.raises(oasiskv.Error, match="num_layers"):
        oasiskv.Cache(make_config(num_layers=0))
    with pytest.raises(oasiskv.Error, match="'median'"):
        make_config(reduction="median")
    with pytest.raises(oasiskv.Error, match="'float64'"):
        oasiskv.Cache(make_config(), dtype="float64")
    with pytest.raises(oasiskv.Error, match="max_tokens_per_sequence"):
        oasiskv.Cache(make_config(max_tokens_per_sequence=2**62))
    assert issubclass(oasiskv.Error, Exception)


@pytest.mark.parametrize("dtype,np_dtype", [("float32", np.float32), ("float16", np.float16)])
def test_round_trip_of_rows_through_the_view(dtype, np_dtype, config, rng):
    cache = oasiskv.Cache(config, dtype=dtype)
    assert cache.dtype == dtype
    cache.add_sequence(3)
    k, v = rows(rng, 100, dtype=np_dtype), rows(rng, 100, dtype=np_dtype)
    cache.append([3], 1, k, v, rows_per_seq=[100])
    assert cache.sequence_length(3, 1) == 100 and cache.sequence_length(3, 0) == 0
    ticket = cache.prefetch([3], 1, rows(rng, 1, heads=8))  # float32 queries into any cache
    assert isinstance(ticket, oasiskv.Ticket) and ticket.layer == 1 and ticket.sequences == [3]
    view = cache.acquire(ticket)
    assert view.valid and view.layer == 1 and view.batch_size == 1 and view.num_kv_heads == 2
    assert view.pool.dtype == np_dtype and not view.pool.flags.writeable
    assert list(view.seq_ids) == [3] and list(view.seq_len) == [100]
    indptr = view.indptr
    assert indptr[0] == 0 and indptr[-1] == len(view.slot) == len(view.block) == len(view.valid_tokens)
    for h in range(2):
        for e in range(indptr[h], indptr[h + 1]):
            b, n = view.block[e], view.valid_tokens[e]
            assert n == min(16, 100 - 16 * b)
            np.testing.assert_array_equal(view.keys(e), k[16 * b:16 * b + n, h])
            np.testing.assert_array_equal(view.values(e), v[16 * b:16 * b + n, h])
            np.testing.assert_array_equal(view.pool[view.slot[e], 0, :n], k[16 * b:16 * b + n, h])
    cache.release(ticket)
    assert not view.valid


def test_bfloat16_cache_takes_uint16_bit_patterns(config, rng):
    cache = oasiskv.Cache(config, dtype="bfloat16")
    cache.add_sequence(1)
    f = rng.standard_normal((20, 2, 64)).astype(np.float32)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)  # truncation: exact bf16 values
    cache.append([1], 0, bits, bits, rows_per_seq=[20])
    with pytest.raises(oasiskv.Error, match="k has dtype float32, expected bfloat16"):
        cache.append([1], 0, f[:1], f[:1])
    t = cache.prefetch([1], 0, rng.standard_normal((1, 8, 64)).astype(np.float32))
    view = cache.acquire(t)
    assert view.pool.dtype == np.uint16
    np.testing.assert_array_equal(view.keys(0), bits[:16, 0])
    cache.release(t)


def test_sequence_operations(config, rng):
    cache = oasiskv.Cache(config)
    cache.add_sequence(1)
    assert cache.has_sequence(1) and not cache.has_sequence(2) and cache.num_sequences == 1
    k = rows(rng, 40)
    for layer in range(2):
        cache.append([1], layer, k, k, rows_per_seq=[40])
    cache.fork(1, 2, 32)
    assert cache.sequence_length(2, 0) == 32 and cache.num_sequences == 2
    cache.fork(1, 3)
    assert cache.sequence_length(3, 1) == 40
    cache.truncate(1, 20)
    assert cache.sequence_length(1, 0) == 20 and cache.sequence_length(1, 1) == 20
    cache.remove_sequence(2)
    assert not cache.has_sequence(2)
    with pytest.raises(oasiskv.Error, match="2"):
        cache.sequence_length(2, 0)
    with pytest.raises(oasiskv.Error):
        cache.add_sequence(1)  # already there
    # select_blocks changes nothing and answers per kv head
    q = rows(rng, 1, heads=8)
    sel = cache.select_blocks(3, 0, q)
    assert len(sel) == 2 and all(isinstance(b, int) for b in sel[0])


def test_attend_returns_the_callbacks_result_and_releases_on_exception(config, rng):
    cache = oasiskv.Cache(config)
    cache.add_sequence(1)
    cache.append([1], 0, rows(rng, 600), rows(rng, 600), rows_per_seq=[600])
    t = cache.prefetch([1], 0, rows(rng, 1, heads=8))
    seen = []

    def fn(view):
        seen.append(view)
        cache.observe(t, rows(rng, 1, heads=8))  # the cache may be called from inside
        return int(view.indptr[-1])

    n = cache.attend(t, fn)
    assert n > 0 and not seen[0].valid
    with pytest.raises(oasiskv.Error, match="released"):
        seen[0].block
    assert cache.statistics().layers[0].observed_true_blocks > 0
    with pytest.raises(oasiskv.Error, match="already acquired and released"):
        cache.acquire(t)

    t2 = cache.prefetch([1], 0, rows(rng, 1, heads=8))
    with pytest.raises(ZeroDivisionError):
        cache.attend(t2, lambda view: 1 / 0)
    with pytest.raises(oasiskv.Error, match="ticket .* is not acquired"):
        cache.release(t2)  # attend released it although fn raised
    t3 = cache.prefetch([1], 0, rows(rng, 1, heads=8))
    cache.release(cache.acquire(t3) and t3)


def test_bad_arrays_raise_error_naming_what_is_wrong(config, rng):
    cache = oasiskv.Cache(config)
    cache.add_sequence(7)
    k, v = rows(rng, 10), rows(rng, 10)
    with pytest.raises(oasiskv.Error, match=r"append: k has dtype float64, expected float32 \(the cache's dtype\)"):
        cache.append([7], 0, k.astype(np.float64), v, rows_per_seq=[10])
    with pytest.raises(oasiskv.Error, match=r"append: v has dtype int32"):
        cache.append([7], 0, k, v.astype(np.int32), rows_per_seq=[10])
    with pytest.raises(oasiskv.Error, match=r"append: k has shape \(10, 2, 32\), expected \(10, 2, 64\)"):
        cache.append([7], 0, k[:, :, :32].copy(), v, rows_per_seq=[10])
    with pytest.raises(oasiskv.Error, match=r"append: k has shape \(10, 128\), expected \(10, 2, 64\)"):
        cache.append([7], 0, k.reshape(10, 128), v, rows_per_seq=[10])
    with pytest.raises(oasiskv.Error, match=r"append: v has shape \(10, 2, 64\), expected \(9, 2, 64\)"):
        cache.append([7], 0, k[:9], v, rows_per_seq=[9])
    strided = rng.standard_normal((10, 2, 128)).astype(np.float32)[:, :, ::2]
    with pytest.raises(oasiskv.Error, match=r"append: k is not C-contiguous"):
        cache.append([7], 0, strided, v, rows_per_seq=[10])
    with pytest.raises(oasiskv.Error, match=r"append: v is not C-contiguous"):
        cache.append([7], 0, k, np.asfortranarray(v), rows_per_seq=[10])
    with pytest.raises(oasiskv.Error, match=r"append: k is a list, expected an array"):
        cache.append([7], 0, k.tolist(), v, rows_per_seq=[10])
    with pytest.raises(oasiskv.Error, match=r"rows_per_seq has 2 entries, the batch 1"):
        cache.append([7], 0, k, v, rows_per_seq=[5, 5])
    with pytest.raises(oasiskv.Error, match=r"rows_per_seq\[0\] = -1"):
        cache.append([7], 0, k, v, rows_per_seq=[-1])
    with pytest.raises(oasiskv.Error, match=r"99"):
        cache.append([99], 0, k[:1], v[:1])  # unknown sequence: the C++ check
    with pytest.raises(oasiskv.Error, match=r"layer"):
        cache.append([7], 5, k[:1], v[:1])
    with pytest.raises(oasiskv.Error, match=r"NaN|non-finite|finite"):
        bad = k[:1].copy()
        bad[0, 1, 3] = np.nan
        cache.append([7], 0, bad, v[:1])
    # A failed call changes nothing.
    assert cache.sequence_length(7, 0) == 0
    cache.append([7], 0, k, v, rows_per_seq=[10])
    q = rows(rng, 1, heads=8)
    with pytest.raises(oasiskv.Error, match=r"prefetch: q_lookahead has dtype float16, expected float32"):
        cache.prefetch([7], 0, q.astype(np.float16))
    with pytest.raises(oasiskv.Error, match=r"prefetch: q_lookahead has shape \(1, 2, 64\), expected \(rows, 8, 64\)"):
        cache.prefetch([7], 0, k[:1])
    with pytest.raises(oasiskv.Error, match=r"expected an oasiskv.Ticket"):
        cache.acquire("ticket")
    t = cache.prefetch([7], 0, q)
    with pytest.raises(oasiskv.Error, match=r"observe: q_true has shape"):
        cache.observe(t, k[:1])
    with pytest.raises(oasiskv.Error, match=r"select_blocks: q is not C-contiguous"):
        cache.select_blocks(7, 0, np.asfortranarray(rng.standard_normal((2, 8, 64)).astype(np.float32)))
    other = oasiskv.Cache(config)
    other.add_sequence(7)
    with pytest.raises(oasiskv.Error, match=r"another cache"):
        other.acquire(t)
    view = cache.acquire(t)
    with pytest.raises(oasiskv.Error, match=r"LayerView.keys: entry 100000 is outside"):
        view.keys(100000)
    with pytest.raises(oasiskv.Error, match=r"under attention|acquired"):
        cache.remove_sequence(7)
    cache.release(t)
    with pytest.raises(oasiskv.Error, match=r"ticket .* is not acquired"):
        cache.release(t)


def test_dlpack_producers_are_taken_without_copies(config, rng):
    cache = oasiskv.Cache(config)
    cache.add_sequence(1)
    k, v = rows(rng, 16), rows(rng, 16)
    cache.append([1], 0, DLPackOnly(k), DLPackOnly(v), rows_per_seq=[16])
    t = cache.prefetch([1], 0, DLPackOnly(rows(rng, 1, heads=8)))
    view = cache.acquire(t)
    np.testing.assert_array_equal(view.keys(0), k[:, 0])
    # The view's arrays are views of the cache's own pool, not copies.
    assert np.shares_memory(view.keys(0), view.pool) and np.shares_memory(view.values(0), view.pool)
    # ... and the pool exports DLPack itself (numpy.from_dlpack of the view shares memory too).
    assert np.shares_memory(np.from_dlpack(view.pool), view.pool)
    cache.release(t)
    with pytest.raises(oasiskv.Error, match=r"append: k has dtype float64"):
        cache.append([1], 0, DLPackOnly(k.astype(np.float64)[:1]), v[:1])
    with pytest.raises(oasiskv.Error, match=r"append: k is not C-contiguous"):
        cache.append([1], 0, DLPackOnly(rng.standard_normal((1, 2, 128)).astype(np.float32)[:, :, ::2]), v[:1])


def test_statistics_count_what_moved(config, rng):
    cache = oasiskv.Cache(config)
    cache.add_sequence(1)
    cache.append([1], 0, rows(rng, 600), rows(rng, 600), rows_per_seq=[600])
    t = cache.prefetch([1], 0, rows(rng, 1, heads=8))
    cache.attend(t, lambda view: None)
    s = cache.statistics()
    assert isinstance(s, oasiskv.Statistics) and len(s.layers) == 2
    l0 = s.layers[0]
    assert l0.plans == 2 and l0.acquires == 1
    assert l0.blocks_fetched == l0.blocks_selected > 0
    assert l0.bytes_fetched == l0.blocks_fetched * 2 * 16 * 64 * 4
    assert s.total().blocks_fetched == l0.blocks_fetched
    assert s.host_blocks_in_use == 38 and s.host_blocks_total > 0
    assert "blocks_fetched=%d" % l0.blocks_fetched in repr(s)
    cache.reset_statistics()
    assert cache.statistics().total().plans == 0


def test_every_field_of_the_cpp_config_is_a_keyword_and_a_property():
    # The fields of the C++ structs, read from the header: a field added there without a binding
    # fails here.
    text = open(f"{REPO}/include/oasiskv/config.hpp").read()

    def fields_of(struct):
        body = re.search(r"struct %s \{(.*?)\n\};" % struct, text, re.S).group(1)
        return re.findall(r"^\s+[\w:<>]+ (\w+)(?: = [^;]+)?;", body, re.M)

    cpp = fields_of("ModelShape") + [f for f in fields_of("CacheConfig") if f != "shape"]
    assert len(cpp) > 15 and "remainder_bits" in cpp and "remainder_cluster_rows" in cpp
    assert list(oasiskv.CacheConfig.field_names) == cpp
    defaults = oasiskv.CacheConfig()
    for name in cpp:
        value = getattr(defaults, name)
        if isinstance(value, str):
            continue
        changed = value + 1 if isinstance(value, int) else value / 2 + 0.125
        c = oasiskv.CacheConfig(**{name: changed})
        assert getattr(c, name) == changed, name
        c = oasiskv.CacheConfig()
        setattr(c, name, changed)
        assert getattr(c, name) == changed and f"{name}={changed!r}" in repr(c), name
    c = oasiskv.CacheConfig(remainder="quantized", remainder_bits=8, remainder_cluster_rows=32, scorer="spread")
    assert (c.remainder, c.remainder_bits, c.remainder_cluster_rows, c.scorer) == ("quantized", 8, 32, "spread")
    with pytest.raises(oasiskv.Error, match=r"no field 'budget' \(the fields: num_layers, "):
        oasiskv.CacheConfig(budget=5)
    with pytest.raises(oasiskv.Error, match=r"block_tokens must be an int, got 'x'"):
        oasiskv.CacheConfig(block_tokens="x")
    with pytest.raises(oasiskv.Error, match=r"block_tokens = 4294967296 does not fit a 32-bit integer"):
        oasiskv.CacheConfig(block_tokens=2**32)
    with pytest.raises(oasiskv.Error, match=r"fetch_ratio must be a number, got True"):
        oasiskv.CacheConfig(fetch_ratio=True)
    with pytest.raises(oasiskv.Error, match=r"remainder must be a str, got 3"):
        oasiskv.CacheConfig(remainder=3)
    assert oasiskv.CacheConfig(max_sequences=np.int64(3), fetch_ratio=np.float32(0.5)).max_sequences == 3


def test_an_uninitialised_object_raises_instead_of_crashing(config, rng):
    cache = oasiskv.Cache(config)
    cache.add_sequence(1)
    cache.append([1], 0, rows(rng, 40), rows(rng, 40), rows_per_seq=[40])
    ticket = cache.prefetch([1], 0, rows(rng, 1, heads=8))

    class Forgetful(oasiskv.Cache):
        def __init__(self):  # never calls super().__init__
            pass

    uninitialised = [Forgetful(), oasiskv.Cache.__new__(oasiskv.Cache)]
    for c in uninitialised:
        for call in (lambda: c.acquire(ticket), lambda: c.attend(ticket, lambda v: None), lambda: c.release(ticket),
                     lambda: c.add_sequence(2), lambda: c.append([1], 0, rows(rng, 1), rows(rng, 1)),
                     lambda: c.prefetch([1], 0, rows(rng, 1, heads=8)), lambda: c.statistics(), lambda: c.num_layers,
                     lambda: c.config, lambda: repr(c), lambda: c.remainder(ticket, rows(rng, 1, heads=8))):
            with pytest.raises(oasiskv.Error, match=r"this Cache is not initialised"):
                call()
    view = oasiskv.LayerView.__new__(oasiskv.LayerView)
    for name in ("layer", "seq_ids", "indptr", "pool", "valid", "batch_size"):
        with pytest.raises(oasiskv.Error, match=r"LayerView.%s: this LayerView is not initialised" % name):
            getattr(view, name)
    with pytest.raises(oasiskv.Error, match=r"this LayerView is not initialised"):
        view.keys(0)
    for cls, attr in ((oasiskv.Ticket, "id"), (oasiskv.Statistics, "layers"), (oasiskv.LayerStatistics, "plans"),
                      (oasiskv.CacheConfig, "block_tokens")):
        obj = cls.__new__(cls)
        with pytest.raises(oasiskv.Error, match=r"this %s is not initialised" % cls.__name__):
            getattr(obj, attr)
        with pytest.raises(oasiskv.Error, match=r"this %s is not initialised" % cls.__name__):
            repr(obj)
    with pytest.raises(oasiskv.Error, match=r"acquire: this Ticket is not initialised"):
        cache.acquire(oasiskv.Ticket.__new__(oasiskv.Ticket))
    cache.attend(ticket, lambda v: None)  # the real cache is untouched


def test_zero_rows_and_other_byte_orders(config, rng):
    cache = oasiskv.Cache(config)
    cache.add_sequence(1)
    cache.add_sequence(2)
    empty = np.zeros((0, 2, 64), np.float32)
    cache.append([1], 0, empty, empty, rows_per_seq=[0])  # as the C++ API: nothing appended
    assert cache.sequence_length(1, 0) == 0
    k = rows(rng, 3)
    cache.append([1, 2], 0, k, k, rows_per_seq=[0, 3])
    assert (cache.sequence_length(1, 0), cache.sequence_length(2, 0)) == (0, 3)
    with pytest.raises(oasiskv.Error, match=r"append: k has the non-native byte order dtype '>f4'"):
        cache.append([1], 0, k[:1].astype(">f4"), k[:1])
    with pytest.raises(oasiskv.Error, match=r"prefetch: q_lookahead has the non-native byte order"):
        cache.prefetch([2], 0, rows(rng, 1, heads=8).astype(">f4"))
    with pytest.raises(oasiskv.Error, match=r"acquire: expected an oasiskv.Ticket \(from prefetch\), got a NoneType"):
        cache.acquire(None)
    with pytest.raises(oasiskv.Error, match=r"append: k is a NoneType, expected an array"):
        cache.append([1], 0, None, k[:1])
    assert (cache.sequence_length(1, 0), cache.sequence_length(2, 0)) == (0, 3)
