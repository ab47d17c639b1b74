"""CacheConfig.scorer (quest | spread | runs) and its constant: keywords, validation, and the
selection of each scorer against numpy's evaluation of its formula (include/oasiskv/config.hpp,
BlockScore) from the appended keys; the runs scorer's run sums through appends in pieces, truncate and
fork."""
import numpy as np
import pytest

import oasiskv
from conftest import make_config

BT = 16


def test_scorer_keywords_round_trip_and_validate():
    config = make_config(scorer="spread", spread_alpha=0.5)
    assert config.scorer == "spread" and "scorer='spread'" in repr(config)
    assert config.spread_alpha == 0.5
    assert make_config().scorer == "quest"
    config.scorer = "quest"
    assert config.scorer == "quest"
    with pytest.raises(oasiskv.Error, match="'bound'"):
        make_config(scorer="bound")
    with pytest.raises(oasiskv.Error, match="spread_alpha must be in \\[0, 1\\], got 1.5"):
        make_config(spread_alpha=1.5).validate()
    with pytest.raises(oasiskv.Error, match="unknown block scorer 'mass'"):
        make_config(scorer="mass")  # measured worse than spread, removed
    config = make_config(scorer="runs", run_tokens=8)
    assert config.scorer == "runs" and config.run_tokens == 8
    assert make_config().run_tokens == 4
    for bad in (0, -4, 3, 32):
        with pytest.raises(oasiskv.Error, match=f"run_tokens must divide block_tokens \\(16\\), got {bad}"):
            make_config(scorer="runs", run_tokens=bad).validate()


def block_scores(kind, q, keys, first, last, alpha, run_tokens=4):
    out = []
    for b in range(first, last):
        kb = keys[b * BT:(b + 1) * BT].astype(np.float64)
        if kind == "runs":  # the best run's mean key
            out.append(max(q @ kb[r:r + run_tokens].mean(axis=0) for r in range(0, BT, run_tokens)))
            continue
        mx, mn = kb.max(axis=0), kb.min(axis=0)
        c, r = 0.5 * (mx + mn), mx - mn
        bound = np.maximum(q * mx, q * mn).sum()
        if kind == "quest":
            out.append(bound)
        else:
            out.append(q @ c + alpha * 0.5 * np.abs(q) @ r)
    return np.array(out)


@pytest.mark.parametrize("kind,run_tokens", [("quest", 4), ("spread", 4), ("runs", 4), ("runs", 8), ("runs", 1)])
def test_selection_follows_the_scorer(kind, run_tokens):
    rng = np.random.default_rng(11 + run_tokens)
    H, G, D, n = 2, 4, 32, 1000
    alpha = 0.4
    config = make_config(num_layers=1, num_q_heads=H * G, num_kv_heads=H, head_dim=D, budget_tokens=256,
                         max_tokens_per_sequence=2048, scorer=kind, spread_alpha=alpha, run_tokens=run_tokens)
    cache = oasiskv.Cache(config)
    cache.add_sequence(1)
    # Blocks of different spreads, so that the scorers rank differently.
    spread = np.repeat(rng.uniform(0.1, 3.0, size=((n + BT - 1) // BT, 1, 1)), BT, axis=0)[:n]
    k = (rng.normal(size=(n, H, D)) * spread).astype(np.float32)
    v = rng.normal(size=(n, H, D)).astype(np.float32)
    cache.append([1], 0, k, v, rows_per_seq=[n])
    q = rng.normal(size=(1, H * G, D)).astype(np.float32)
    picked = cache.select_blocks(1, 0, q)
    # Candidates: after the sink block, before the recent ring of the next step (64 tokens + the tail).
    first, ring = config.sink_tokens // BT, config.recent_tokens // BT + 1
    last = min((n + BT - 1) // BT, (n + 1 + BT - 1) // BT - ring)
    checked = 0
    for h in range(H):
        total = sum(block_scores(kind, q[0, h * G + g].astype(np.float64), k[:, h], first, last, alpha, run_tokens)
                    for g in range(G))
        order = np.argsort(-total, kind="stable")
        want = len(picked[h])
        assert want > 0
        # Skip the check where float rounding could swap the last pick with the next block.
        if want < len(order) and abs(total[order[want - 1]] - total[order[want]]) < 1e-3 * (1 + abs(total[order[want]])):
            continue
        assert sorted(int(b) for b in picked[h]) == sorted(int(b) + first for b in order[:want])
        checked += 1
    assert checked > 0  # not every head a near tie


@pytest.mark.parametrize("dtype,np_dtype", [("float32", np.float32), ("float16", np.float16)])
def test_run_sums_survive_appends_in_pieces_truncate_and_fork(dtype, np_dtype):
    """The runs scorer's run sums are folded on append (in pieces that split runs and blocks), refolded
    on truncate, copied on fork: each cache then selects what a cache given the same rows at once does."""
    rng = np.random.default_rng(3)
    H, G, D = 2, 3, 16

    def cache_of(*seqs):
        config = make_config(num_layers=1, num_q_heads=H * G, num_kv_heads=H, head_dim=D, budget_tokens=128,
                             max_tokens_per_sequence=2048, scorer="runs", reduction="max")
        cache = oasiskv.Cache(config, dtype=dtype)
        for s in seqs:
            cache.add_sequence(s)
        return cache

    def rows(n):
        return rng.normal(size=(n, H, D)).astype(np_dtype), rng.normal(size=(n, H, D)).astype(np_dtype)

    k, v = rows(700)
    k2, v2 = rows(300)
    q = rng.normal(size=(1, H * G, D)).astype(np.float32)
    # The reference: the final rows appended at once.
    whole = cache_of(1)
    want_k, want_v = np.concatenate([k[:421], k2]), np.concatenate([v[:421], v2])
    whole.append([1], 0, want_k, want_v, rows_per_seq=[len(want_k)])
    want = whole.select_blocks(1, 0, q)
    # In pieces of 1, 3, 18 and the rest, cut back to 421 (inside a run), then the new rows.
    pieces = cache_of(1)
    at = 0
    for n in (1, 3, 18, 700 - 22):
        pieces.append([1], 0, k[at:at + n], v[at:at + n], rows_per_seq=[n])
        at += n
    pieces.truncate(1, 421)
    pieces.fork(1, 2)  # the fork copies the run sums of whole blocks and refolds the partial one
    for s in (1, 2):
        pieces.append([s], 0, k2, v2, rows_per_seq=[len(k2)])
        assert pieces.select_blocks(s, 0, q) == want, s
    # Not a selection that any rows give: other rows pick other blocks.
    other_k, _ = rows(len(want_k))
    other = cache_of(1)
    other.append([1], 0, other_k, other_k, rows_per_seq=[len(want_k)])
    assert other.select_blocks(1, 0, q) != want
