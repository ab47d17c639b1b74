// Host code using oasiskv::cuda: runs anywhere. With a device it makes a Cache<cuda, float>;
// without one the constructor's clear Error is the expected outcome.
#include <cstdio>

#include <oasiskv/cuda/cache.hpp>

int main() {
  const int n = oasiskv::gpu::device_count();
  std::printf("consumer_cuda: %d CUDA device(s)\n", n);
  oasiskv::CacheConfig config;
  config.shape = oasiskv::ModelShape{2, 8, 2, 64};
  config.budget_tokens = 256;
  config.max_tokens_per_sequence = 1024;
  try {
    oasiskv::Cache<oasiskv::cuda, float> cache(config);
    cache.add_sequence(1);
    std::printf("consumer_cuda: Cache<cuda, float> on device %d\n", cache.backend().device());
  } catch (const oasiskv::Error& e) {
    std::printf("consumer_cuda: no cache: %s\n", e.what());
    if (n > 0) return 1;
  }
  return 0;
}
