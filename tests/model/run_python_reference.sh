#!/usr/bin/env bash
# Reruns tools/model_reference/reference.py (numpy + gguf + tokenizers) and compares the engine's
# logits with it. Exit 77 (ctest: skipped) when those Python packages are not installed.
# Usage: run_python_reference.sh SMOLLM2_INSPECT REPO_ROOT
set -euo pipefail
inspect="$1"
repo="$2"
if ! python3 -c "import numpy, gguf, tokenizers" 2>/dev/null; then
  echo "skipped: python3 with numpy, gguf and tokenizers is needed (pip install numpy gguf tokenizers)"
  exit 77
fi
model="${OASISKV_MODEL_PATH:-${OASISKV_MODEL_DIR:-$repo/.cache/models}/SmolLM2-135M-Instruct.Q4_1.gguf}"
if [[ ! -f "$model" ]]; then
  if [[ "${OASISKV_SKIP_MODEL_TESTS:-}" == "1" ]]; then echo "skipped: no model"; exit 77; fi
  echo "SmolLM2 model not found at $model; run scripts/fetch-model first" >&2
  exit 1
fi
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
python3 "$repo/tools/model_reference/reference.py" --model "$model" --text /usr/share/common-licenses/GPL-3 --out "$out"
result="$(OASISKV_MODEL_PATH="$model" "$inspect" reference "$out")"
echo "$result"
# Same tolerance and reasoning as test_reference_logits.cpp.
python3 - "$result" <<'PY'
import re, sys
line = sys.argv[1]
diff = float(re.search(r"max \|logit diff\| (\S+)", line).group(1))
ok = diff < 1e-3 and "top-1 matches" in line
sys.exit(0 if ok else 1)
PY
