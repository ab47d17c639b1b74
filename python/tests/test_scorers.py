"""CacheConfig.scorer (quest | spread) and its constant: keywords, validation, and the
selection of each scorer against numpy's evaluation of its formula (include/oasiskv/config.hpp,
BlockScore) from the appended keys."""
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


def block_scores(kind, q, keys, first, last, alpha):
    out = []
    for b in range(first, last):
        kb = keys[b * BT:(b + 1) * BT].astype(np.float64)
        mx, mn = kb.max(axis=0), kb.min(axis=0)
        c, r = 0.5 * (mx + mn), mx - mn
        bound = np.maximum(q * mx, q * mn).sum()
        if kind == "quest":
            out.append(bound)
        else:
            out.append(q @ c + alpha * 0.5 * np.abs(q) @ r)
    return np.array(out)


@pytest.mark.parametrize("kind", ["quest", "spread"])
def test_selection_follows_the_scorer(kind):
    rng = np.random.default_rng(11)
    H, G, D, n = 2, 4, 32, 1000
    alpha = 0.4
    config = make_config(num_layers=1, num_q_heads=H * G, num_kv_heads=H, head_dim=D, budget_tokens=256,
                         max_tokens_per_sequence=2048, scorer=kind, spread_alpha=alpha)
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
        total = sum(block_scores(kind, q[0, h * G + g].astype(np.float64), k[:, h], first, last, alpha)
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
