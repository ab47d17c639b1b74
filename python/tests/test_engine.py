"""The Python engine (examples/python/smollm2_oasiskv.py: the numpy reference model decoding through
oasiskv.Cache) produces the C++ engine's tokens (smollm2-generate, fp32 weights and KV) with the
same prompt, config and budget. Both run here; no token is hard-coded."""
import importlib.util
import os
import re
import subprocess

import pytest

from conftest import REPO

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_FILE = "/usr/share/common-licenses/GPL-3"
PROMPT_TOKENS, NEW_TOKENS, BUDGET = 192, 16, 128  # 12 prompt blocks, 8 resident: 2 of them selected


def model_path():
    if os.environ.get("OASISKV_MODEL_PATH"):
        return os.environ["OASISKV_MODEL_PATH"]
    if os.environ.get("OASISKV_MODEL_DIR"):
        return os.path.join(os.environ["OASISKV_MODEL_DIR"], MODEL_NAME)
    return os.path.join(REPO, ".cache", "models", MODEL_NAME)


def generate_binary():
    path = os.environ.get("OASISKV_SMOLLM2_GENERATE") or os.path.join(
        REPO, "build", "default", "examples", "smollm2", "smollm2-generate")
    return path


def requirements():
    if os.environ.get("OASISKV_SKIP_MODEL_TESTS") == "1":
        return "OASISKV_SKIP_MODEL_TESTS=1"
    if not os.path.isfile(model_path()):
        return f"the model is absent ({model_path()}; scripts/fetch-model)"
    if not os.access(generate_binary(), os.X_OK):
        return f"the C++ engine is not built ({generate_binary()}; set OASISKV_SMOLLM2_GENERATE)"
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is absent (the numpy reference reads the model with it)"
    if not os.path.isfile(PROMPT_FILE):
        return f"{PROMPT_FILE} is absent"
    return None


@pytest.mark.skipif(requirements() is not None, reason=str(requirements()))
def test_python_engine_tokens_equal_the_cpp_engines():
    run = subprocess.run(
        [generate_binary(), "--model", model_path(), "--prompt-file", PROMPT_FILE, "--prompt-tokens",
         str(PROMPT_TOKENS), "--tokens", str(NEW_TOKENS), "--budget", str(BUDGET), "--weights", "fp32", "--kv", "fp32",
         "--drafter", "ngram", "--ignore-eos", "--print-ids", "--threads", "2"],
        capture_output=True, text=True, timeout=600, check=True)

    def ids(name):
        return [int(t) for t in re.search(rf"^{name} ids: (.*)$", run.stdout, re.M).group(1).split()]

    prompt, cpp_tokens = ids("prompt"), ids("oasiskv")
    cpp_fetched = int(re.search(r"blocks fetched (\d+)", run.stdout).group(1))
    # Steps with a lookahead row and steps without (no 2-3 token match) both ran.
    drafted, forwards = map(int, re.search(r"a draft in (\d+) of (\d+) forwards", run.stdout).groups())
    assert 0 < drafted < forwards
    assert len(prompt) == PROMPT_TOKENS and len(cpp_tokens) == NEW_TOKENS

    spec = importlib.util.spec_from_file_location("smollm2_oasiskv",
                                                  os.path.join(REPO, "examples", "python", "smollm2_oasiskv.py"))
    engine_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine_module)
    engine = engine_module.Engine(model_path())
    tokens, stats = engine_module.generate(engine, prompt, NEW_TOKENS, budget=BUDGET)
    assert tokens == cpp_tokens
    # The same blocks moved: the two engines planned the same working sets.
    assert stats.total().blocks_fetched == cpp_fetched
    assert stats.total().acquires == (NEW_TOKENS - 1) * engine.n_layers
