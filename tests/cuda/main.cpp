// doctest main of oasiskv_cuda_tests. Listing test cases (ctest discovery) works anywhere; running
// them needs a CUDA device: without one, prints how many are skipped and exits 77, which ctest
// reports as "Skipped" (SKIP_RETURN_CODE 77).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>

#include "cuda/cuda_support.hpp"
#include "oasiskv/cuda/check.hpp"

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strstr(argv[i], "list-test") != nullptr || std::strstr(argv[i], "-ltc") != nullptr ||
        std::strstr(argv[i], "-lts") != nullptr || std::strstr(argv[i], "count") != nullptr ||
        std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "--help") == 0) {
      listing = true;
    }
  }
  if (!listing && !oasiskv::gpu::device_available()) {
    int selected = oasiskv::gpu_test::registered_tests();
    for (int i = 1; i < argc; ++i) {
      if (std::strncmp(argv[i], "--test-case=", 12) == 0 || std::strncmp(argv[i], "-tc=", 4) == 0) selected = 1;
    }
    std::printf("no CUDA device: %d CUDA tests skipped\n", selected);
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
