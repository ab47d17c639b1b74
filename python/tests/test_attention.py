"""Random append / prefetch / attend against numpy: the blocks each view holds are the Quest top-K a
numpy selector computes from the same rows and queries, their rows are the appended rows, and the
attention over the view equals a numpy reference attention over those tokens (and dense attention
when the budget covers the context)."""
import numpy as np
import pytest

import oasiskv

BT = 16


def quest_topk(keys, length, q_rows, group, sink_blocks, cand_end, k_select):
    """Blocks [sink_blocks, cand_end) ranked by the sum over query rows and the group's heads of
    sum_i max(q_i * max_i, q_i * min_i); top k_select, ties to the lower block."""
    scores = []
    for b in range(sink_blocks, cand_end):
        rows = keys[b * BT:min((b + 1) * BT, length)].astype(np.float64)  # [n][d]
        hi, lo = rows.max(axis=0), rows.min(axis=0)
        s = 0.0
        for q in q_rows:  # [group][d]
            for g in range(group):
                s += np.maximum(q[g] * hi, q[g] * lo).sum()
        scores.append((-s, b))
    scores.sort()
    return {b for _, b in scores[:k_select]}


def attention(q, keys, values, scale):
    s = keys.astype(np.float64) @ q.astype(np.float64) * scale
    w = np.exp(s - s.max())
    return (w / w.sum()) @ values.astype(np.float64)


@pytest.mark.parametrize("dtype,np_dtype,tol", [("float32", np.float32, 1e-5), ("float16", np.float16, 1e-3)])
def test_random_decode_against_numpy(dtype, np_dtype, tol):
    rng = np.random.default_rng(7)
    H, G, D, L = 2, 4, 32, 2
    QH = H * G
    budget, sink, recent = 128, 16, 32  # 8 slots: 1 sink, 3 ring, 4 selectable
    config = oasiskv.CacheConfig(num_layers=L, num_q_heads=QH, num_kv_heads=H, head_dim=D, budget_tokens=budget,
                                 sink_tokens=sink, recent_tokens=recent, max_sequences=3,
                                 max_tokens_per_sequence=1024)
    cache = oasiskv.Cache(config, dtype=dtype)
    S, ring, K = sink // BT, recent // BT + 1, budget // BT - sink // BT - (recent // BT + 1)
    scale = 1.0 / np.sqrt(D)
    batch = [11, 22, 33]
    prompt = [300, 137, 90]
    mirror = {(s, l): [np.zeros((0, H, D), np_dtype)] * 2 for s in batch for l in range(L)}
    for s in batch:
        cache.add_sequence(s)

    def blocks_for(n):
        return (n + BT - 1) // BT

    def ring_start(n):
        return max(blocks_for(n) - ring, S)

    def add_rows(layer, counts):
        total = sum(counts)
        k = rng.standard_normal((total, H, D)).astype(np_dtype)
        v = rng.standard_normal((total, H, D)).astype(np_dtype)
        cache.append(batch, layer, k, v, rows_per_seq=counts)
        at = 0
        for s, n in zip(batch, counts):
            mk, mv = mirror[(s, layer)]
            mirror[(s, layer)] = [np.concatenate([mk, k[at:at + n]]), np.concatenate([mv, v[at:at + n]])]
            at += n

    def plan(layer):
        q = (rng.standard_normal((len(batch), QH, D)) * 2).astype(np.float32)
        ticket = cache.prefetch(batch, layer, q)
        expected = {}
        for i, s in enumerate(batch):
            keys = mirror[(s, layer)][0]
            n = len(keys)
            cand_end = max(min(blocks_for(n), ring_start(n + 1)), S)
            for h in range(H):
                expected[(s, h)] = quest_topk(keys[:, h], n, [q[i, h * G:(h + 1) * G]], G, S, cand_end, K)
        return ticket, expected

    def check(view, expected, layer, q_now):
        assert list(view.seq_ids) == batch
        indptr, slot, block, valid = view.indptr, view.slot, view.block, view.valid_tokens
        for i, s in enumerate(batch):
            mk, mv = mirror[(s, layer)]
            n = len(mk)
            assert view.seq_len[i] == n
            for h in range(H):
                p = i * H + h
                got = [int(b) for b in block[indptr[p]:indptr[p + 1]]]
                want = sorted(set(range(min(S, blocks_for(n)))) |
                              {b for b in expected[(s, h)] if b < ring_start(n)} |
                              set(range(ring_start(n), blocks_for(n))))
                assert got == want, (s, h, got, want)
                tokens = np.concatenate([np.arange(b * BT, min((b + 1) * BT, n)) for b in want])
                keys = np.concatenate([view.keys(e) for e in range(indptr[p], indptr[p + 1])])
                values = np.concatenate([view.values(e) for e in range(indptr[p], indptr[p + 1])])
                assert list(valid[indptr[p]:indptr[p + 1]]) == [min(BT, n - b * BT) for b in want]
                np.testing.assert_array_equal(keys, mk[tokens, h])
                np.testing.assert_array_equal(values, mv[tokens, h])
                for g in range(h * G, (h + 1) * G):
                    sparse = attention(q_now[i, g], keys, values, scale)
                    ref = attention(q_now[i, g], mk[tokens, h], mv[tokens, h], scale)
                    np.testing.assert_allclose(sparse, ref, rtol=tol, atol=tol)
                    if len(want) == blocks_for(n):  # the budget covers it all: dense attention
                        np.testing.assert_allclose(sparse, attention(q_now[i, g], mk[:, h], mv[:, h], scale),
                                                   rtol=tol, atol=tol)

    previous = {}
    for layer in range(L):  # prefill, first plans (uncapped)
        add_rows(layer, prompt)
        previous[layer] = plan(layer)
    for step in range(12):
        for layer in range(L):
            add_rows(layer, [1, 1, 1])
            nxt = plan(layer)
            q_now = rng.standard_normal((len(batch), QH, D)).astype(np.float32)
            ticket, expected = previous[layer]
            cache.attend(ticket, lambda view: check(view, expected, layer, q_now))
            previous[layer] = nxt
    st = cache.statistics().total()
    assert st.acquires == 12 * L and st.blocks_fetched > 0


def test_covering_budget_equals_dense_attention():
    rng = np.random.default_rng(3)
    config = oasiskv.CacheConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, budget_tokens=256,
                                 max_sequences=1, max_tokens_per_sequence=256)
    cache = oasiskv.Cache(config)
    cache.add_sequence(5)
    k = rng.standard_normal((150, 2, 16)).astype(np.float32)
    v = rng.standard_normal((150, 2, 16)).astype(np.float32)
    cache.append([5], 0, k, v, rows_per_seq=[150])
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    t = cache.prefetch([5], 0, q)

    def fn(view):
        out = np.zeros((4, 16))
        for g in range(4):
            h = g // 2
            e = range(view.indptr[h], view.indptr[h + 1])
            keys = np.concatenate([view.keys(i) for i in e])
            values = np.concatenate([view.values(i) for i in e])
            out[g] = attention(q[0, g], keys, values, 0.25)
        return out

    out = cache.attend(t, fn)
    for g in range(4):
        np.testing.assert_allclose(out[g], attention(q[0, g], k[:, g // 2], v[:, g // 2], 0.25), rtol=1e-6, atol=1e-6)
