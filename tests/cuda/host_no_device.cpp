// The CUDA backend's host paths that must work on any machine, with or without a GPU: error
// translation, device queries, the pinned host tier's pageable fallback.
#include <doctest/doctest.h>

#include <cstring>
#include <string>

#include "oasiskv/error.hpp"
#include "oasiskv/cuda/cache.hpp"
#include "oasiskv/cuda/check.hpp"
#include "oasiskv/cuda/device_memory.hpp"
#include "oasiskv/cuda/pinned_region.hpp"

using namespace oasiskv;

TEST_CASE("cuda check turns a CUDA error into oasiskv::Error naming it") {
  try {
    OASISKV_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL("no throw");
  } catch (const Error& e) {
    const std::string what = e.what();
    CHECK(what.find("cudaErrorInvalidValue") != std::string::npos);
    CHECK(what.find("cudaErrorInvalidValue failed") != std::string::npos);  // the call text
  }
}

TEST_CASE("cuda device queries never throw") {
  const int n = gpu::device_count();
  CHECK(n >= 0);
  CHECK(gpu::device_available() == (n > 0));
}

TEST_CASE("cuda pinned region: pinned with a device, ordinary memory with a warning without one") {
  gpu::PinnedRegion r(std::size_t{3} << 20, 8192, std::size_t{1} << 20);  // 3 chunks when pinned
  REQUIRE(r.data() != nullptr);
  std::memset(r.data(), 0x5a, r.bytes());
  CHECK(static_cast<unsigned char>(r.data()[r.bytes() - 1]) == 0x5a);
  if (gpu::device_available()) {
    CHECK(r.pinned());
    CHECK(r.chunks() == 3);
    CHECK(r.device_data() == r.data());
  } else {
    CHECK_FALSE(r.pinned());
    CHECK(r.device_data() == nullptr);
  }
}

TEST_CASE("cuda device memory without a device fails with oasiskv::Error, not a crash") {
  if (gpu::device_available()) return;
  try {
    gpu::DeviceBuffer<float> b(16);
    FAIL("cudaMalloc succeeded without a device");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("cudaMalloc") != std::string::npos);
  }
}

TEST_CASE("cuda Cache<cuda> without a device fails with oasiskv::Error, not a crash") {
  if (gpu::device_available()) return;
  CacheConfig c;
  c.shape = ModelShape{2, 4, 2, 16};
  c.max_sequences = 2;
  c.max_tokens_per_sequence = 256;
  CHECK_THROWS_AS((Cache<cuda, float>(c)), Error);
  CHECK_THROWS_WITH_AS((Cache<cuda, bf16_t>(c, CudaOptions{.max_query_rows = 2, .tickets_per_layer = 3})),
                       doctest::Contains("cuda"), Error);
}

TEST_CASE("cuda Cache<cuda> refuses bad options before touching the device") {
  CacheConfig c;
  c.shape = ModelShape{2, 4, 2, 16};
  c.max_sequences = 2;
  c.max_tokens_per_sequence = 256;
  CHECK_THROWS_WITH_AS((Cache<cuda, float>(c, CudaOptions{.max_query_rows = 0})),
                       doctest::Contains("max_query_rows must be positive, got 0"), Error);
  CHECK_THROWS_WITH_AS((Cache<cuda, float>(c, CudaOptions{.tickets_per_layer = 0})),
                       doctest::Contains("tickets_per_layer must be positive, got 0"), Error);
  CHECK_THROWS_WITH_AS((Cache<cuda, float>(c, CudaOptions{.query_staging_buffers = 0})),
                       doctest::Contains("query_staging_buffers must be positive, got 0"), Error);
  c.shape.num_layers = 0;
  CHECK_THROWS_WITH_AS((Cache<cuda, float>(c)), doctest::Contains("num_layers must be positive"), Error);
}
