// Helpers for the CUDA tests: a registry count (main prints how many tests a machine without a
// GPU skips), stream-ordered upload/download/fill, and OASISKV_CUDA_TEST_CASE.
//
// Every transfer is ordered on the stream the test then launches on: upload and fill enqueue
// (cudaMemcpyAsync, cudaMemsetAsync) before the test's launches on that stream, and download
// enqueues after them and synchronises that stream before the host reads. Nothing goes through
// the legacy default stream, so a missing dependency in the code under test is neither hidden by
// an implicit synchronisation nor invented by one.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "oasiskv/config.hpp"
#include "oasiskv/cuda/check.hpp"
#include "oasiskv/cuda/device_memory.hpp"

namespace oasiskv::gpu_test {

inline int& registry() {
  static int n = 0;
  return n;
}
inline int registered_tests() { return registry(); }
inline int count_test() { return ++registry(); }

// host[0, n) -> dst, enqueued on `stream` (pageable source: staged before the call returns).
template <class T>
void upload_to(T* dst, const std::vector<T>& host, cudaStream_t stream) {
  if (!host.empty()) {
    OASISKV_CUDA_CHECK(cudaMemcpyAsync(dst, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
}

// A new device array holding `host` (at least one element, so data() is never null) once the
// stream's earlier work is done.
template <class T>
gpu::DeviceBuffer<T> upload(const std::vector<T>& host, cudaStream_t stream) {
  gpu::DeviceBuffer<T> d(std::max<std::size_t>(host.size(), 1));
  upload_to(d.data(), host, stream);
  return d;
}

// A new device array of n elements, every byte `byte`, on `stream`.
template <class T>
gpu::DeviceBuffer<T> filled(std::size_t n, int byte, cudaStream_t stream) {
  gpu::DeviceBuffer<T> d(std::max<std::size_t>(n, 1));
  d.fill_async(byte, stream);
  return d;
}

// d[0, n) after the stream's work so far: enqueued on `stream`, which is then synchronised.
template <class T>
std::vector<T> download(const T* d, std::size_t n, cudaStream_t stream) {
  std::vector<T> host(n);
  if (n > 0) OASISKV_CUDA_CHECK(cudaMemcpyAsync(host.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

template <class T>
std::vector<T> download(const gpu::DeviceBuffer<T>& d, std::size_t n, cudaStream_t stream) {
  return download(d.data(), n, stream);
}

template <class T>
std::vector<T> download(const gpu::DeviceBuffer<T>& d, cudaStream_t stream) {
  return download(d.data(), d.size(), stream);
}

// The block map of a host tier laid out as before pools: sequence slot s's logical block b is
// pool block s * max_blocks + b (the default pool holds exactly those). For kernel tests that
// build their own host tier.
inline std::vector<std::int32_t> identity_block_map(const CacheLayout& L) {
  std::vector<std::int32_t> map(static_cast<std::size_t>(L.config.max_sequences) * static_cast<std::size_t>(L.max_blocks));
  for (std::size_t i = 0; i < map.size(); ++i) map[i] = static_cast<std::int32_t>(i);
  return map;
}

}  // namespace oasiskv::gpu_test

#define OASISKV_CUDA_CAT2(a, b) a##b
#define OASISKV_CUDA_CAT(a, b) OASISKV_CUDA_CAT2(a, b)
// A doctest TEST_CASE that main() counts (to report how many are skipped without a GPU).
#define OASISKV_CUDA_TEST_CASE(name)                                                           \
  [[maybe_unused]] static const int OASISKV_CUDA_CAT(oasiskv_cuda_test_reg_, __COUNTER__) = \
      ::oasiskv::gpu_test::count_test();                                                     \
  TEST_CASE(name)
