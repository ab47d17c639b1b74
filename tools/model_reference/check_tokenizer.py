#!/usr/bin/env python3
"""Compares the C++ tokenizer (smollm2-inspect tokenize) with the reference tokenizer (HuggingFace
`tokenizers` built from the GGUF vocabulary, see reference.py) on text files.

Usage: check_tokenizer.py --inspect BUILD/examples/smollm2/smollm2-inspect --model M.gguf FILE...
Exit status 1 on the first file whose ids differ (prints the first differing position)."""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGUFReader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import build_tokenizer  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--inspect", required=True)
ap.add_argument("--model", required=True)
ap.add_argument("files", nargs="+")
args = ap.parse_args()
tk = build_tokenizer(GGUFReader(args.model))
env = dict(os.environ, OASISKV_MODEL_PATH=args.model)
failed = False
for path in args.files:
    with tempfile.NamedTemporaryFile(suffix=".bin") as out:
        subprocess.run([args.inspect, "tokenize", path, out.name], check=True, env=env, capture_output=True)
        cpp = np.fromfile(out.name, dtype="<i4").tolist()
    ref = tk.encode(open(path, encoding="utf-8", newline="").read()).ids
    if cpp == ref:
        print(f"{path}: {len(ref)} tokens, identical")
        continue
    failed = True
    first = next((i for i, (a, b) in enumerate(zip(cpp, ref)) if a != b), min(len(cpp), len(ref)))
    print(f"{path}: DIFFER at token {first} (C++ {len(cpp)} tokens, reference {len(ref)})")
    print("  C++:", [tk.id_to_token(i) for i in cpp[max(0, first - 3): first + 5]])
    print("  ref:", [tk.id_to_token(i) for i in ref[max(0, first - 3): first + 5]])
sys.exit(1 if failed else 0)
