# Sourced by the scripts in scripts/ and .ci/run: common environment. Not executable on its own.
# Puts a CUDA toolkit installed in the usual place on PATH so CMake's check_language(CUDA) sees it.
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
# Parallelism for cmake --build / ctest unless the caller chose.
if [[ -z "${CMAKE_BUILD_PARALLEL_LEVEL:-}" ]]; then
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || echo 2)"
  export CMAKE_BUILD_PARALLEL_LEVEL
fi
if [[ -z "${CTEST_PARALLEL_LEVEL:-}" ]]; then
  export CTEST_PARALLEL_LEVEL="$CMAKE_BUILD_PARALLEL_LEVEL"
fi
