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
