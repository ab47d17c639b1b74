#!/usr/bin/env python3
"""Proves that scripts/check-include-floors fails where it should: in a temporary tree, a clean
layout passes, and each kind of include off its floor (a shared header or shared source taking a
backend's or the remote tier's header, the CUDA backend taking the CPU's, the CPU backend taking
the CUDA's) fails with exit 1, naming the file and line. Standard library only.
Usage: tests/structure/test_include_floors.py <path of scripts/check-include-floors>
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

CLEAN = {
    "include/oasiskv/config.hpp": "#pragma once\n",
    "include/oasiskv/kit/tier.hpp": '#pragma once\n// oasiskv/cpu/engine.hpp reads this (a comment, not an include)\n#include "oasiskv/config.hpp"\n',
    "include/oasiskv/detail/checked.hpp": '#pragma once\n#include "oasiskv/kit/tier.hpp"\n',
    "include/oasiskv/cpu/engine.hpp": '#pragma once\n#include "oasiskv/kit/tier.hpp"\n',
    "include/oasiskv/cuda/engine.hpp": '#pragma once\n#include <oasiskv/detail/checked.hpp>\n',
    "src/config.cpp": '#include "oasiskv/config.hpp"\n',
    "src/cpu/kernels.cpp": '#include "oasiskv/cpu/engine.hpp"\n',
    "cuda/kernels.cu": '#include "oasiskv/cuda/engine.hpp"\n',
}

# (file, its text, the line the checker must name)
BAD = [
    ("include/oasiskv/detail/summary.hpp", '#pragma once\n\n#include "oasiskv/cpu/engine.hpp"\n', 3),
    ("include/oasiskv/kit/pool.hpp", "#pragma once\n#  include <oasiskv/cuda/engine.hpp>\n", 2),
    ("include/oasiskv/kit/remote.hpp", '#pragma once\n#include "oasiskv/ucx/remote_tier.hpp"\n', 2),
    ("src/admission.cpp", '#include "oasiskv/config.hpp"\n#include "oasiskv/cpu/engine.hpp"\n', 2),
    ("include/oasiskv/cuda/detail/clusters.hpp", '#pragma once\n#include "oasiskv/cpu/engine.hpp"\n', 2),
    ("cuda/runtime.cpp", '#include "oasiskv/cpu/engine.hpp"\n', 1),
    ("include/oasiskv/cpu/detail/store.hpp", '#pragma once\n#include "oasiskv/cuda/engine.hpp"\n', 2),
    ("src/cpu/top_k.cpp", '#include "oasiskv/cuda/engine.hpp"\n', 1),
]


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def run(checker: str, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, checker, str(root)], capture_output=True, text=True, timeout=600)


def main() -> int:
    checker = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        clean = Path(tmp) / "clean"
        write(clean, CLEAN)
        r = run(checker, clean)
        if r.returncode != 0:
            failures.append(f"a clean tree failed (exit {r.returncode}): {r.stderr.strip()}")
        for i, (rel, text, line) in enumerate(BAD):
            root = Path(tmp) / f"bad{i}"
            write(root, CLEAN)
            write(root, {rel: text})
            r = run(checker, root)
            if r.returncode != 1:
                failures.append(f"{rel}: expected exit 1, got {r.returncode}")
            elif f"{rel}:{line}:" not in r.stderr:
                failures.append(f"{rel}: the report does not name {rel}:{line}: {r.stderr.strip()}")
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    if failures:
        return 1
    print(f"include floors: a clean tree passes and all {len(BAD)} violations are caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
