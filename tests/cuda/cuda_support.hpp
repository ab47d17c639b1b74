// Helpers for the CUDA tests: a registry count (main prints how many tests a machine without a
// GPU skips), device upload/download, and OASISKV_CUDA_TEST_CASE.
#pragma once

#include <cstddef>
#include <vector>

#include <cuda_runtime_api.h>

#include "oasiskv/cuda/check.cuh"
#include "oasiskv/cuda/components.cuh"

namespace oasiskv::gpu_test {

inline int& registry() {
  static int n = 0;
  return n;
}
inline int registered_tests() { return registry(); }
inline int count_test() { return ++registry(); }

template <class T>
gpu::DeviceBuffer<T> upload(const std::vector<T>& host) {
  gpu::DeviceBuffer<T> d(host.size() == 0 ? 1 : host.size(), false);
  if (!host.empty()) OASISKV_CUDA_CHECK(cudaMemcpy(d.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <class T>
std::vector<T> download(const gpu::DeviceBuffer<T>& d, std::size_t n) {
  std::vector<T> host(n);
  if (n > 0) OASISKV_CUDA_CHECK(cudaMemcpy(host.data(), d.data(), n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

template <class T>
std::vector<T> download(const T* d, std::size_t n) {
  std::vector<T> host(n);
  if (n > 0) OASISKV_CUDA_CHECK(cudaMemcpy(host.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace oasiskv::gpu_test

#define OASISKV_CUDA_CAT2(a, b) a##b
#define OASISKV_CUDA_CAT(a, b) OASISKV_CUDA_CAT2(a, b)
// A doctest TEST_CASE that main() counts (to report how many are skipped without a GPU).
#define OASISKV_CUDA_TEST_CASE(name)                                                                \
  [[maybe_unused]] static const int OASISKV_CUDA_CAT(oasiskv_cuda_test_reg_, __LINE__) = \
      ::oasiskv::gpu_test::count_test();                                                          \
  TEST_CASE(name)
