// The CUDA operations refuse arguments they cannot launch for with oasiskv::Error, before any
// CUDA call: so these run on any machine, with or without a GPU.
#include <doctest/doctest.h>

#include <string>

#include "oasiskv/config.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/cuda/ops.hpp"

using namespace oasiskv;

namespace {

CacheLayout layout(int selectable_blocks, std::int64_t max_tokens) {
  CacheConfig c;
  c.shape = ModelShape{1, 1, 1, 8};
  c.block_tokens = 16;
  c.sink_tokens = 16;
  c.recent_tokens = 16;
  c.budget_tokens = 16 * (selectable_blocks + 3);
  c.max_tokens_per_sequence = max_tokens;
  return CacheLayout::from(c);
}

}  // namespace

TEST_CASE("cuda gather_admits refuses more than 65,535 admits per pair (gridDim.y)") {
  const CacheLayout L = layout(70000, 1024);
  REQUIRE(L.selectable_blocks == 70000);
  const std::int32_t slot = 0;
  const std::int64_t len = 0;
  const gpu::DeviceBatch batch{1, &slot, &len};
  CHECK_THROWS_WITH_AS(gpu::gather_admits<float>(L, 0, batch, nullptr, nullptr, gpu::DeviceHostTier<float>{}, nullptr, nullptr),
                       doctest::Contains("gather_admits: 70000 admits per pair (selectable_blocks) exceed CUDA's "
                                         "gridDim.y limit of 65,535"),
                       Error);
}

TEST_CASE("cuda score_blocks refuses more than 65,535 candidate tiles (gridDim.y)") {
  const std::int64_t blocks = std::int64_t{65536} * 32 + 2;  // 2 tiles too many, with the sink
  const CacheLayout L = layout(4, blocks * 16);
  const std::int32_t slot = 0;
  const std::int64_t len = 0;
  const gpu::DeviceBatch batch{1, &slot, &len};
  const gpu::ScoreBuffers out{nullptr, nullptr, nullptr, nullptr, static_cast<int>(L.max_blocks)};
  CHECK_THROWS_WITH_AS(gpu::score_blocks<float>(L, 0, batch, nullptr, 1, nullptr, out, nullptr),
                       doctest::Contains("candidate tiles of 32 blocks exceed CUDA's gridDim.y limit of 65,535"),
                       Error);
}

TEST_CASE("cuda clear_residency and plan_transfers refuse bad arguments") {
  const CacheLayout L = layout(4, 1024);
  std::int32_t b = 0;
  std::int64_t t = 0;
  CHECK_THROWS_WITH_AS(gpu::clear_residency(L, 1, 0, &b, &t, nullptr), doctest::Contains("sequence slot 1 is outside [-1, 1)"),
                       Error);
  CHECK_THROWS_WITH_AS(gpu::clear_residency(L, 0, 1, &b, &t, nullptr), doctest::Contains("layer 1 is outside [-1, 1)"),
                       Error);
  CHECK_THROWS_WITH_AS(gpu::clear_residency(L, -2, 0, &b, &t, nullptr), doctest::Contains("sequence slot -2"), Error);
  CHECK_THROWS_AS(gpu::clear_residency(L, 0, 0, nullptr, &t, nullptr), Error);
  const std::int32_t slot = 0;
  const std::int64_t len = 0;
  gpu::DeviceAdmit admit;
  std::int32_t count = 0;
  CHECK_THROWS_WITH_AS(gpu::plan_transfers(L, 0, gpu::DeviceBatch{1, &slot, &len}, &t, nullptr, nullptr, nullptr, 4,
                                           nullptr, nullptr, gpu::PlanBuffers{&admit, &count}, nullptr),
                       doctest::Contains("steps and caps are required"), Error);
}

TEST_CASE("cuda cluster_segment and the per-head segmented_top_k refuse bad arguments") {
  const CacheLayout L = layout(4, 2048);
  float scratch = 0.0f, sums = 0.0f;
  std::int32_t counts = 0;
  std::uint8_t ids = 0, flags = 0;
  gpu::DeviceClusters c{&sums, &counts, &ids, &flags, 64, 1024, 2};
  CHECK_THROWS_WITH_AS(gpu::cluster_segment<float>(L, 0, 0, 2, gpu::DeviceHostTier<float>{}, c, &scratch, nullptr),
                       doctest::Contains("segment 2 out of range"), Error);
  CHECK_THROWS_WITH_AS(gpu::cluster_segment<float>(L, 1, 0, 0, gpu::DeviceHostTier<float>{}, c, &scratch, nullptr),
                       doctest::Contains("sequence slot 1"), Error);
  gpu::DeviceClusters many = c;
  many.k = 512;  // one-byte ids
  CHECK_THROWS_WITH_AS(gpu::cluster_segment<float>(L, 0, 0, 0, gpu::DeviceHostTier<float>{}, many, &scratch, nullptr),
                       doctest::Contains("512 clusters per segment"), Error);
  CHECK_THROWS_WITH_AS(gpu::cluster_segment<float>(L, 0, 0, 0, gpu::DeviceHostTier<float>{}, c, nullptr, nullptr),
                       doctest::Contains("cluster_segment"), Error);
  const HeadBudget heads[1]{};
  CHECK_THROWS_WITH_AS(gpu::segmented_top_k(nullptr, 1, nullptr, nullptr, 1, 4, heads, 0, nullptr, nullptr, nullptr),
                       doctest::Contains("num_kv_heads = 0 must be positive"), Error);
}
