"""LayerView.attention, the CPU attention over a view's resident blocks: against a numpy reference
built from the view's own entries (LayerView.keys / values and their positions), on fresh random
rows, for every pool dtype, one and several rows a sequence (causal by position), GQA, a batch of
sequences of different lengths; and every bad argument refused."""
import numpy as np
import pytest

import oasiskv
from conftest import make_config

BT = 16


def reference(view, q, rows, scale, pool_dtype):
    """out [B*R][QH][D] and lse [B*R][QH] in float64 from the view's entries."""
    B, H, D = view.batch_size, view.num_kv_heads, view.head_dim
    QH = q.shape[1]
    group = QH // H
    indptr, block, valid, seq_len = view.indptr, view.block, view.valid_tokens, view.seq_len
    out = np.zeros((B * rows, QH, D))
    lse = np.full((B * rows, QH), -np.inf)
    for i in range(B):
        for h in range(H):
            p = i * H + h
            keys, values, positions = [], [], []
            for e in range(indptr[p], indptr[p + 1]):
                keys.append(view.keys(e).astype(np.float64))
                values.append(view.values(e).astype(np.float64))
                positions.append(block[e] * BT + np.arange(valid[e]))
            if pool_dtype == "bfloat16":  # the pool hands bfloat16 out as uint16 bit patterns
                keys = [(k.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for k in
                        [view.keys(e) for e in range(indptr[p], indptr[p + 1])]]
                values = [(v.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for v in
                          [view.values(e) for e in range(indptr[p], indptr[p + 1])]]
            keys, values, positions = np.concatenate(keys), np.concatenate(values), np.concatenate(positions)
            for r in range(rows):
                seen = positions <= seq_len[i] - rows + r
                for g in range(h * group, (h + 1) * group):
                    s = keys[seen] @ q[i * rows + r, g].astype(np.float64) * scale
                    top = s.max()
                    w = np.exp(s - top)
                    out[i * rows + r, g] = w @ values[seen] / w.sum()
                    lse[i * rows + r, g] = top + np.log(w.sum())
    return out, lse


@pytest.mark.parametrize("dtype,np_dtype", [("float32", np.float32), ("float16", np.float16),
                                            ("bfloat16", np.float32)])
@pytest.mark.parametrize("rows", [1, 3])
def test_attention_equals_reference_over_the_view(dtype, np_dtype, rows):
    rng = np.random.default_rng(11 + rows)
    H, G, D = 2, 3, 40  # head_dim not a multiple of 8: the dot's tail
    config = make_config(num_layers=1, num_q_heads=H * G, num_kv_heads=H, head_dim=D, budget_tokens=96,
                         sink_tokens=16, recent_tokens=32)
    cache = oasiskv.Cache(config, dtype=dtype)
    batch, lengths = [5, 9], [203, 77]
    for s in batch:
        cache.add_sequence(s)
    for s, n in zip(batch, lengths):
        k = rng.standard_normal((n, H, D)).astype(np_dtype)
        v = rng.standard_normal((n, H, D)).astype(np_dtype)
        if dtype == "bfloat16":  # numpy has no bfloat16: the rows go in as uint16 bit patterns
            k, v = (k.view(np.uint32) >> 16).astype(np.uint16), (v.view(np.uint32) >> 16).astype(np.uint16)
        cache.append([s], 0, k, v, rows_per_seq=[n])
    q = (rng.standard_normal((len(batch) * rows, H * G, D)) * 2).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    ticket = cache.prefetch(batch, 0, np.ascontiguousarray(q[rows - 1::rows]), next_step_rows=rows)
    view = cache.acquire(ticket)
    assert view.indptr[-1] > view.batch_size * view.num_kv_heads  # several blocks a pair
    out, lse = view.attention(q, scale)
    want_out, want_lse = reference(view, q, rows, scale, dtype)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    # Into the caller's arrays.
    o, l = np.full_like(out, np.nan), np.full_like(lse, np.nan)
    view.attention(q, scale, out=o, lse=l)
    assert np.array_equal(o, out) and np.array_equal(l, lse)
    cache.release(ticket)


def test_attention_refuses_bad_arguments():
    config = make_config(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, budget_tokens=128,
                         sink_tokens=16, recent_tokens=32)
    cache = oasiskv.Cache(config)
    cache.add_sequence(1)
    cache.add_sequence(2)
    rng = np.random.default_rng(3)
    for s in (1, 2):
        cache.append([s], 0, rng.standard_normal((40, 2, 16)).astype(np.float32),
                     rng.standard_normal((40, 2, 16)).astype(np.float32), rows_per_seq=[40])
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    ticket = cache.prefetch([1, 2], 0, q)
    view = cache.acquire(ticket)
    with pytest.raises(oasiskv.Error, match="q has 3 rows, expected a positive multiple of the view's batch_size 2"):
        view.attention(np.zeros((3, 4, 16), np.float32), 0.25)
    with pytest.raises(oasiskv.Error, match="q has dtype float16, expected float32"):
        view.attention(q.astype(np.float16), 0.25)
    with pytest.raises(oasiskv.Error, match="q"):
        view.attention(np.zeros((2, 3, 16), np.float32), 0.25)
    with pytest.raises(oasiskv.Error, match="scale nan is not finite"):
        view.attention(q, float("nan"))
    with pytest.raises(oasiskv.Error, match="pass both out and lse"):
        view.attention(q, 0.25, out=np.zeros((2, 4, 16), np.float32))
    with pytest.raises(oasiskv.Error, match="out has shape"):
        view.attention(q, 0.25, out=np.zeros((2, 4, 8), np.float32), lse=np.zeros((2, 4), np.float32))
    with pytest.raises(oasiskv.Error, match="q"):
        view.attention(None, 0.25)
    cache.release(ticket)
    with pytest.raises(oasiskv.Error, match="released"):
        view.attention(q, 0.25)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_threads_give_the_plan_of_one_thread_and_the_reference_attention(dtype):
    """Cache(threads=2): prefetch plans the same blocks as one thread; LayerView.attention, whose heads of
    1,024 rows and more are split over the threads, agrees with one thread and the reference to rounding."""
    rng = np.random.default_rng(29)
    H, G, D = 2, 3, 64  # a tiled head dim
    config = make_config(num_layers=1, num_q_heads=H * G, num_kv_heads=H, head_dim=D, budget_tokens=1280,
                         sink_tokens=16, recent_tokens=64)
    batch, lengths = [3, 4, 8], [2500, 1700, 300]
    rows = [(rng.standard_normal((n, H, D)), rng.standard_normal((n, H, D))) for n in lengths]
    q = (rng.standard_normal((len(batch), H * G, D)) * 2).astype(np.float32)
    results = []
    for threads in (1, 2):
        cache = oasiskv.Cache(config, dtype=dtype, threads=threads)
        for s, (k, v) in zip(batch, rows):
            k, v = k.astype(np.float32), v.astype(np.float32)
            if dtype == "bfloat16":
                k, v = (k.view(np.uint32) >> 16).astype(np.uint16), (v.view(np.uint32) >> 16).astype(np.uint16)
            cache.add_sequence(s)
            cache.append([s], 0, k, v, rows_per_seq=[len(k)])
        ticket = cache.prefetch(batch, 0, q)
        view = cache.acquire(ticket)
        assert max(view.valid_tokens[view.indptr[0]:view.indptr[1]].sum(), 0) >= 1024  # split over the threads
        out, lse = view.attention(q, 1.0 / np.sqrt(D))
        want_out, want_lse = reference(view, q, 1, 1.0 / np.sqrt(D), dtype)
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
        results.append((view.block.copy(), view.indptr.copy(), out, lse))
        cache.release(ticket)
    (block1, indptr1, out1, lse1), (block2, indptr2, out2, lse2) = results
    assert np.array_equal(block1, block2) and np.array_equal(indptr1, indptr2)
    np.testing.assert_allclose(out2, out1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse2, lse1, rtol=1e-5, atol=1e-5)


def test_threads_refused_naming_the_value():
    config = make_config(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, budget_tokens=128,
                         sink_tokens=16, recent_tokens=32)
    with pytest.raises(oasiskv.Error, match="threads 0 is below 1"):
        oasiskv.Cache(config, threads=0)
    with pytest.raises(oasiskv.Error, match="threads 2 is for a CPU cache; this one is on cuda"):
        oasiskv.Cache(config, device="cuda", threads=2)
