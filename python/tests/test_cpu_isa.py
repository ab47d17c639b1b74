"""The instruction-set level (OASISKV_CPU_ISA, read when the module loads): the level in use is the
one asked for, LayerView.attention gives the reference's values at every level the CPU supports, and
a value that cannot be honoured raises oasiskv.Error naming it, never a crash. Each level runs in a
child interpreter, since the variable is read once."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import oasiskv

LEVELS = ["scalar", "avx2", "avx512"]

# A child's program: the level in use, and LayerView.attention over a fixed random view.
CHILD = r"""
import json, sys
import numpy as np
import oasiskv
out = {"isa": oasiskv.cpu_isa()}
rng = np.random.default_rng(5)
H, G, D, n = 2, 3, 64, 300
config = oasiskv.CacheConfig(num_layers=1, num_q_heads=H * G, num_kv_heads=H, head_dim=D, budget_tokens=96,
                             sink_tokens=16, recent_tokens=32, max_sequences=1, max_tokens_per_sequence=512)
cache = oasiskv.Cache(config, dtype="float16")
cache.add_sequence(1)
cache.append([1], 0, rng.standard_normal((n, H, D)).astype(np.float16), rng.standard_normal((n, H, D)).astype(np.float16),
             rows_per_seq=[n])
q = rng.standard_normal((1, H * G, D)).astype(np.float32)
view = cache.acquire(cache.prefetch([1], 0, q))
o, lse = view.attention(q, 1.0 / np.sqrt(D))
out["out"] = o.ravel().tolist()
out["lse"] = lse.ravel().tolist()
print(json.dumps(out))
"""


def run_child(level, program=CHILD):
    env = dict(os.environ, OASISKV_CPU_ISA=level)
    return subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=600)


def test_the_level_in_use_is_at_most_the_cpus():
    assert oasiskv.cpu_isa_supported() in LEVELS
    assert LEVELS.index(oasiskv.cpu_isa()) <= LEVELS.index(oasiskv.cpu_isa_supported())


def test_every_supported_level_is_honoured_and_attends_as_the_others():
    supported = LEVELS[: LEVELS.index(oasiskv.cpu_isa_supported()) + 1]
    results = {}
    for level in supported:
        child = run_child(level)
        assert child.returncode == 0, child.stderr
        results[level] = json.loads(child.stdout)
        assert results[level]["isa"] == level
    # The vector kernel and the portable one: the same values to float rounding (another order of
    # the sums, FMA), on the same view.
    base = results["scalar"]
    for level, r in results.items():
        np.testing.assert_allclose(r["out"], base["out"], rtol=1e-5, atol=1e-6, err_msg=level)
        np.testing.assert_allclose(r["lse"], base["lse"], rtol=1e-5, atol=1e-6, err_msg=level)


@pytest.mark.parametrize("value", ["avx3", "AVX2", "sse4"])
def test_an_unknown_level_raises_naming_it(value):
    program = r"""
import oasiskv, sys
for call in (oasiskv.cpu_isa, lambda: oasiskv.Cache(oasiskv.CacheConfig(num_layers=1, num_q_heads=2, num_kv_heads=1,
             head_dim=16, budget_tokens=128, max_sequences=1, max_tokens_per_sequence=256))):
    try:
        call()
        print("no error")
        sys.exit(1)
    except oasiskv.Error as e:
        print(e)
"""
    child = run_child(value, program)
    assert child.returncode == 0, child.stdout + child.stderr
    lines = child.stdout.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert f"OASISKV_CPU_ISA={value}" in line and "not an instruction-set level" in line


def test_a_level_above_the_cpus_raises_naming_it():
    supported = oasiskv.cpu_isa_supported()
    if supported == "avx512":
        pytest.skip("this CPU supports every level")
    above = LEVELS[LEVELS.index(supported) + 1]
    child = run_child(above, "import oasiskv\ntry:\n    oasiskv.cpu_isa()\nexcept oasiskv.Error as e:\n    print(e)\n")
    assert child.returncode == 0, child.stderr
    assert f"OASISKV_CPU_ISA={above}" in child.stdout and f"supports up to {supported}" in child.stdout
