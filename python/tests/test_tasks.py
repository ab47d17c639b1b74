"""The task suite's harness (experiments/smollm2/tasks.py) at a small size: a planted pass key is placed where
asked and found by dense attention and by OasisKVCache at a budget covering the prompt, and answers are scored
as the suite says. Accuracy at sparse budgets is measured by the suite itself (docs/evaluation/tasks.md), not
asserted here."""
import os
import sys
from fractions import Fraction

import pytest

from conftest import REPO
from test_transformers import model_dir, needs_model

sys.path.insert(0, os.path.join(REPO, "experiments", "smollm2"))
import tasks  # noqa: E402


def test_answers_are_scored_by_their_digits_in_order():
    assert tasks.correct(" 30316. Remember it.", ["30316"])
    assert not tasks.correct(" 30326", ["30316"])
    assert not tasks.correct(" 303161", ["30316"])  # a longer number is not the key
    assert tasks.correct(" 4821, 9930, 1234", ["4821", "9930", "1234"])
    assert not tasks.correct(" 9930, 4821, 1234", ["4821", "9930", "1234"])  # out of order
    assert tasks.budget_tokens(Fraction(1, 8), 1000) == 128
    assert tasks.budget_tokens(Fraction(1), 1001) == 1008  # a covering budget rounds up


@pytest.fixture(scope="module")
def loaded():
    return tasks.load_model(model_dir())


@needs_model
def test_needles_sit_at_their_depths(loaded):
    _, tokenizer = loaded
    for depth in (0.1, 0.5, 0.9):
        trial = tasks.make_trial(tokenizer, "passkey", 800, depth, seed=1)
        key = trial.expected[0]
        text = trial.user
        at = text.index(f"The pass key is {key}.")
        body = text.index("\n\n") + 2, text.rindex("\n\n")
        share = (at - body[0]) / (body[1] - body[0])
        assert abs(share - depth) < 0.08, (depth, share)
        ids = tasks.prompt_ids(tokenizer, trial)
        assert 800 < trial.tokens < 1000 and ids.shape == (1, trial.tokens)


@needs_model
def test_dense_and_a_covering_budget_find_the_planted_key(loaded):
    model, tokenizer = loaded
    import torch

    torch.set_num_threads(2)
    trials = [tasks.make_trial(tokenizer, "passkey", 600, 0.5, seed=0)]
    configs = tasks.configurations([Fraction(1)], ["none"], ["previous"])
    results = tasks.run_suite(model, tokenizer, trials, configs, log=lambda s: None)
    assert [r["config"] for r in results] == ["dense", "1 none previous"]
    for r in results:
        assert r["correct"], r
    assert results[1]["budget"] >= results[1]["tokens"]
    table = tasks.summarize(results)
    assert table[("1 none previous", "passkey")] == dict(n=1, right=1, dense_right=1, right_where_dense=1)


def test_the_simulated_selection_is_the_librarys():
    """task_trace.py's torch rules for the library's scorers pick the blocks Cache.select_blocks picks, on fresh
    random rows (a channel with outliers), at lengths on and off a block boundary, for both reductions (runs:R
    in task_trace is R runs a block: the library's run_tokens = 16 / R)."""
    import numpy as np
    import torch

    import oasiskv
    import task_trace
    from conftest import make_config

    H, G, D = 3, 3, 64
    for seed, (n, rule, reduction) in enumerate([(700, "quest", "sum"), (703, "quest", "max"),
                                                 (655, "spread:0.25", "sum"), (512, "spread:0.25", "max"),
                                                 (690, "runs:4", "max"), (611, "runs:4", "sum"), (577, "runs:8", "max")]):
        rng = np.random.default_rng(seed)
        kind, _, arg = rule.partition(":")
        constant = ({"spread_alpha": float(arg)} if kind == "spread" else
                    {"run_tokens": 16 // int(arg)} if kind == "runs" else {})
        cfg = make_config(num_layers=1, num_q_heads=H * G, num_kv_heads=H, head_dim=D, budget_tokens=192,
                          sink_tokens=16, recent_tokens=64, reduction=reduction, scorer=kind, **constant)
        cache = oasiskv.Cache(cfg, dtype="float32")
        cache.add_sequence(1)
        k = rng.standard_normal((n, H, D)).astype(np.float32)
        k[:, :, 3] *= 6
        cache.append([1], 0, k, rng.standard_normal((n, H, D)).astype(np.float32), rows_per_seq=[n])
        q = (rng.standard_normal((1, H * G, D)) * 2).astype(np.float32)
        library = cache.select_blocks(1, 0, q)
        sim = task_trace.SparseAttention(rule, reduction, 192)
        length = n + 1  # the plan is for the next step's sequence
        ring_start = sim.ring_start(length)
        for g in range(H):
            s = task_trace.block_scores(rule, torch.from_numpy(q[0, g * G:(g + 1) * G]), torch.from_numpy(k[:, g]),
                                        ring_start)[:, sim.sink_blocks:]
            s = s.sum(0) if reduction == "sum" else s.max(0).values
            mine = (torch.topk(s, sim.k_sel).indices + sim.sink_blocks).tolist()
            assert sorted(library[g]) == sorted(mine), (n, rule, reduction, g)


@needs_model
def test_the_simulated_attention_at_a_covering_budget_is_dense(loaded):
    """The torch decode attention of task_trace.py over every block gives dense's logits: what it drops at a
    sparse budget is what the rule left out, nothing else."""
    import torch
    from transformers import AttentionInterface, DynamicCache

    import task_trace
    from oasiskv.transformers import CACHE_KWARG

    model, tokenizer = loaded
    trial = tasks.make_trial(tokenizer, "passkey", 400, 0.5, seed=0)
    ids = tasks.prompt_ids(tokenizer, trial)
    previous = model.config._attn_implementation

    def decode(steps=4):
        cache, out = DynamicCache(), []
        with torch.no_grad():
            logits = model(ids, use_cache=True, **{CACHE_KWARG: cache}).logits[0, -1]
            for _ in range(steps):
                token = logits.argmax().view(1, 1)
                logits = model(token, use_cache=True, **{CACHE_KWARG: cache}).logits[0, -1]
                out.append(logits)
        return torch.stack(out)

    dense = decode()
    AttentionInterface.register("oasiskv_simulate", task_trace.SparseAttention("quest", "sum", 4096))
    model.set_attn_implementation("oasiskv_simulate")
    try:
        sparse = decode()
    finally:
        model.set_attn_implementation(previous)
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-4)
