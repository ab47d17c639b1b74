"""Cache.remainder: the estimate of the blocks an acquired view leaves out, against numpy's
evaluation of the same formula (include/oasiskv/config.hpp, RemainderEstimate::clusters: under a
segment every block by its own centroid) from the appended rows, and merged with the view's attention it is nearer dense attention than the view alone
on keys with block structure."""
import numpy as np
import pytest

import oasiskv
from conftest import make_config

BT = 16


def softmax_state(q, keys, values, scale):
    s = keys.astype(np.float64) @ q.astype(np.float64) * scale
    m = s.max()
    w = np.exp(s - m)
    return (w / w.sum()) @ values.astype(np.float64), m + np.log(w.sum())


def merge(a, lse_a, b, lse_b):
    m = max(lse_a, lse_b)
    wa, wb = np.exp(lse_a - m), np.exp(lse_b - m)
    return (wa * a + wb * b) / (wa + wb)


def test_remainder_matches_numpy_and_helps():
    rng = np.random.default_rng(5)
    H, G, D = 2, 4, 32
    n = 1000  # under a 1,024-row segment: nothing clustered, every block by its sums
    config = make_config(num_layers=1, num_q_heads=H * G, num_kv_heads=H, head_dim=D, budget_tokens=256,
                         max_tokens_per_sequence=2048, remainder="clusters")
    assert config.remainder == "clusters" and "remainder='clusters'" in repr(config)
    cache = oasiskv.Cache(config)
    cache.add_sequence(1)
    # Keys clustered by block (a block's rows share a centre), values likewise.
    centres = rng.normal(size=((n + BT - 1) // BT, H, D)).astype(np.float32)
    k = (np.repeat(centres, BT, axis=0)[:n] + 0.1 * rng.normal(size=(n, H, D))).astype(np.float32)
    v = (np.repeat(rng.normal(size=centres.shape), BT, axis=0)[:n] + 0.1 * rng.normal(size=(n, H, D))).astype(np.float32)
    cache.append([1], 0, k, v, rows_per_seq=[n])
    q = rng.normal(size=(1, H * G, D)).astype(np.float32)
    ticket = cache.prefetch([1], 0, q)
    view = cache.acquire(ticket)
    out, lse = cache.remainder(ticket, q)
    assert out.shape == (1, H * G, D) and lse.shape == (1, H * G)
    scale = 1.0 / np.sqrt(D)
    err_view, err_merged = [], []
    for h in range(H):
        held = set(int(b) for b in view.block[view.indptr[h]:view.indptr[h + 1]])
        left = [b for b in range((n + BT - 1) // BT) if b not in held]
        assert left  # the budget (16 blocks) leaves most of the 63 out
        held_rows = np.concatenate([np.arange(b * BT, min((b + 1) * BT, n)) for b in sorted(held)])
        for g in range(G):
            qh = q[0, h * G + g].astype(np.float64)
            logits, values = [], []
            for b in left:
                rows = slice(b * BT, min((b + 1) * BT, n))
                kb, vb = k[rows, h].astype(np.float64), v[rows, h].astype(np.float64)
                logits.append(np.log(len(kb)) + scale * qh @ kb.mean(axis=0))
                values.append(vb.mean(axis=0))
            logits = np.array(logits)
            m = logits.max()
            w = np.exp(logits - m)
            want_out = (w[:, None] * np.array(values)).sum(axis=0) / w.sum()
            want_lse = m + np.log(w.sum())
            np.testing.assert_allclose(out[0, h * G + g], want_out, rtol=1e-4, atol=1e-5)
            assert abs(lse[0, h * G + g] - want_lse) < 1e-4 * max(1.0, abs(want_lse))
            # Merged with the view's own attention state, nearer dense than the view alone.
            dense, _ = softmax_state(qh, k[:, h], v[:, h], scale)
            part, part_lse = softmax_state(qh, k[held_rows, h], v[held_rows, h], scale)
            merged = merge(part, part_lse, out[0, h * G + g].astype(np.float64), float(lse[0, h * G + g]))
            err_view.append(np.linalg.norm(part - dense))
            err_merged.append(np.linalg.norm(merged - dense))
    assert np.mean(err_merged) < np.mean(err_view)
    cache.release(ticket)
    with pytest.raises(oasiskv.Error, match="not acquired"):
        cache.remainder(ticket, q)


def test_remainder_refused_when_off_and_zero_when_all_resident(rng):
    cache = oasiskv.Cache(make_config(num_layers=1))
    cache.add_sequence(3)
    k = rng.random((100, 2, 64), dtype=np.float32)
    cache.append([3], 0, k, k, rows_per_seq=[100])
    q = rng.random((1, 8, 64), dtype=np.float32)
    t = cache.prefetch([3], 0, q)
    cache.acquire(t)
    with pytest.raises(oasiskv.Error, match="remainder"):
        cache.remainder(t, q)
    cache.release(t)
    on = oasiskv.Cache(make_config(num_layers=1, remainder="clusters"))
    on.add_sequence(3)
    on.append([3], 0, k, k, rows_per_seq=[100])  # 100 tokens: the 256-token budget holds them all
    t = on.prefetch([3], 0, q)
    on.acquire(t)
    out, lse = on.remainder(t, q)
    assert np.all(np.isneginf(lse)) and np.all(out == 0)
    on.release(t)
    with pytest.raises(oasiskv.Error, match="'median'"):
        make_config(remainder="median")


def test_removed_estimates_are_refused():
    for name in ("centroid", "gaussian", "variance"):  # measured worse than clusters and quantized
        with pytest.raises(oasiskv.Error, match="expected none, clusters or quantized"):
            make_config(remainder=name)


def test_clusters_estimate_beats_block_centroid_on_scattered_centres():
    """remainder="clusters": keys around centres scattered over positions (a block mixes centres);
    the estimate of the left-out rows' attention is nearer the exact one than the block centroid;
    remainder="quantized" (the left-out rows themselves, at 8 bits) nearer still."""
    rng = np.random.default_rng(11)
    H, G, D, n = 2, 4, 32, 1100  # one full 1,024-row segment, clustered when it fills
    centres_k = 1.5 * rng.normal(size=(40, H, D))
    centres_v = rng.normal(size=(40, H, D))
    pick = rng.integers(0, 40, size=(n, H))
    k = (centres_k[pick, np.arange(H)] + 0.1 * rng.normal(size=(n, H, D))).astype(np.float32)
    v = (centres_v[pick, np.arange(H)] + 0.1 * rng.normal(size=(n, H, D))).astype(np.float32)
    q = (2.0 * rng.normal(size=(1, H * G, D))).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    errors = {}
    # The block centroid, from the rows (what clusters gives a segment it has not clustered).
    centroid = oasiskv.Cache(make_config(num_layers=1, num_q_heads=H * G, num_kv_heads=H, head_dim=D,
                                         budget_tokens=256, max_tokens_per_sequence=2048))
    centroid.add_sequence(1)
    centroid.append([1], 0, k, v, rows_per_seq=[n])
    ticket = centroid.prefetch([1], 0, q)
    view = centroid.acquire(ticket)
    err = 0.0
    for h in range(H):
        held = set(int(b) for b in view.block[view.indptr[h]:view.indptr[h + 1]])
        rows = np.array([t for t in range(n) if t // BT not in held])
        left = sorted(set(rows // BT))
        for g in range(G):
            qh = q[0, h * G + g].astype(np.float64)
            logits = np.array([np.log(len(k[b * BT:(b + 1) * BT])) +
                               scale * qh @ k[b * BT:(b + 1) * BT, h].astype(np.float64).mean(axis=0) for b in left])
            values = np.array([v[b * BT:(b + 1) * BT, h].astype(np.float64).mean(axis=0) for b in left])
            m = logits.max()
            w = np.exp(logits - m)
            want, want_lse = softmax_state(q[0, h * G + g], k[rows, h], v[rows, h], scale)
            err += np.abs((w[:, None] * values).sum(axis=0) / w.sum() - want).sum() + abs(m + np.log(w.sum()) - want_lse)
    centroid.release(ticket)
    errors["centroid"] = err
    for kind in ("clusters", "quantized"):
        config = make_config(num_layers=1, num_q_heads=H * G, num_kv_heads=H, head_dim=D, budget_tokens=256,
                             max_tokens_per_sequence=2048, remainder=kind)
        if kind == "quantized":
            config.remainder_bits = 8  # the left-out rows at 8 bits: close to exact
        cache = oasiskv.Cache(config)
        cache.add_sequence(1)
        cache.append([1], 0, k, v, rows_per_seq=[n])
        ticket = cache.prefetch([1], 0, q)
        view = cache.acquire(ticket)
        out, lse = cache.remainder(ticket, q)
        err = 0.0
        for h in range(H):
            held = set(int(b) for b in view.block[view.indptr[h]:view.indptr[h + 1]])
            rows = np.array([t for t in range(n) if t // BT not in held])
            for g in range(G):
                want, want_lse = softmax_state(q[0, h * G + g], k[rows, h], v[rows, h], scale)
                err += np.abs(out[0, h * G + g] - want).sum() + abs(lse[0, h * G + g] - want_lse)
        cache.release(ticket)
        errors[kind] = err
    assert errors["clusters"] < 0.5 * errors["centroid"], errors
    assert errors["quantized"] < 0.1 * errors["clusters"], errors
    bad = make_config(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=32, remainder="clusters")
    bad.remainder_cluster_rows = 12
    with pytest.raises(oasiskv.Error, match="remainder_cluster_rows must be a power of two.* got 12"):
        bad.validate()
    bad = make_config(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=32, remainder="quantized")
    assert bad.remainder_bits == 4
    bad.remainder_bits = 9
    with pytest.raises(oasiskv.Error, match=r"remainder_bits must be in \[2, 8\], got 9"):
        bad.validate()
