// The GPU benchmark's BlockGather (bench/cuda: the zero-copy gather kernel vs one
// cudaMemcpyBatchAsync), the reference sparse attention kernel against the CPU reference, and
// CUDA errors as oasiskv::Error. Every transfer is stream-ordered (cuda_support.hpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "block_gather.hpp"
#include "cuda/cuda_support.hpp"
#include "oasiskv/view.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/reference_attention.hpp"
#include "oasiskv/cuda/ops.hpp"
#include "oasiskv/cuda/pinned_region.hpp"
#include "support.hpp"

namespace oasiskv::gpu_test {

OASISKV_CUDA_TEST_CASE("cuda block gather: zero-copy kernel and DMA batch copy the same bytes, nothing else") {
  OASISKV_SEEDED_RNG(rng);
  gpu::Stream stream;
  constexpr std::size_t kBlock = 8192;
  const std::size_t src_blocks = 300, dst_blocks = 256;
  gpu::PinnedRegion host(src_blocks * kBlock, kBlock);
  REQUIRE(host.pinned());
  for (std::size_t i = 0; i < host.bytes(); ++i) host.data()[i] = static_cast<std::byte>(rng());
  using gpu_bench::GatherMethod;
  for (GatherMethod method : {GatherMethod::zero_copy_kernel, GatherMethod::dma_batch}) {
    INFO("method " << static_cast<int>(method));
    gpu_bench::BlockGather gather(256, method);
    // Three runs through the same gather: the zero-copy method reuses its first staging buffer
    // on the third run (after its host wait).
    for (int run = 0; run < 3; ++run) {
      std::vector<unsigned char> before(dst_blocks * kBlock);
      for (auto& b : before) b = static_cast<unsigned char>(rng());
      auto dst = upload(before, stream);
      std::vector<std::size_t> targets(dst_blocks);
      std::iota(targets.begin(), targets.end(), 0);
      std::shuffle(targets.begin(), targets.end(), rng);
      const std::size_t n = 1 + rng() % 200;
      std::vector<BlockCopy> copies;
      std::vector<unsigned char> expected = before;
      for (std::size_t c = 0; c < n; ++c) {
        const std::size_t src = rng() % src_blocks;
        copies.push_back(BlockCopy{host.device_data() + src * kBlock, dst.data() + targets[c] * kBlock, kBlock});
        std::memcpy(expected.data() + targets[c] * kBlock, host.data() + src * kBlock, kBlock);
      }
      gather.run(copies, stream);
      CHECK(download(dst, stream) == expected);
    }
  }
  CHECK_THROWS_AS(gpu_bench::BlockGather(0, GatherMethod::zero_copy_kernel), Error);
  gpu_bench::BlockGather small(2, GatherMethod::dma_batch);
  const std::vector<BlockCopy> three(3);
  CHECK_THROWS_AS(small.run(three, stream), Error);
}

namespace {

template <KvElement T>
void run_attention_test() {
  OASISKV_SEEDED_RNG(rng);
  gpu::Stream stream;
  const int dims[] = {16, 64, 128};
  const int d = dims[rng() % 3], bt = 16, H = 1 + static_cast<int>(rng() % 3), G = 1 + static_cast<int>(rng() % 4);
  const int nq = H * G, B = 1 + static_cast<int>(rng() % 4), slots = 64;
  INFO("head_dim " << d << ", kv heads " << H << ", group " << G << ", batch " << B);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const std::int64_t stride = 2LL * bt * d;
  std::vector<T> pool(static_cast<std::size_t>(slots * stride));
  for (auto& x : pool) x = from_float<T>(dist(rng));
  std::vector<std::int32_t> indptr{0}, slot, block, valid;
  std::vector<SeqId> ids;
  std::vector<std::int64_t> lens;
  for (int i = 0; i < B; ++i) {
    ids.push_back(static_cast<SeqId>(i + 100));
    lens.push_back(0);
    for (int h = 0; h < H; ++h) {
      const int n = static_cast<int>(rng() % 12);
      for (int e = 0; e < n; ++e) {
        slot.push_back(static_cast<std::int32_t>(rng() % slots));
        block.push_back(e);
        valid.push_back(1 + static_cast<std::int32_t>(rng() % bt));
      }
      indptr.push_back(static_cast<std::int32_t>(slot.size()));
    }
  }
  std::vector<float> q(static_cast<std::size_t>(B * nq * d));
  for (auto& x : q) x = dist(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  LayerView<T> view;
  view.batch_size = B;
  view.num_kv_heads = H;
  view.head_dim = d;
  view.block_tokens = bt;
  view.seq_ids = ids.data();
  view.seq_len = lens.data();
  view.indptr = indptr.data();
  view.slot = slot.data();
  view.block = block.data();
  view.valid_tokens = valid.data();
  view.pool = pool.data();
  view.slot_stride = stride;
  std::vector<float> expected(q.size());
  sparse_attention_reference(view, nq, scale, q.data(), expected.data());

  auto dids = upload(ids, stream);
  auto dlens = upload(lens, stream);
  auto dindptr = upload(indptr, stream);
  auto dslot = upload(slot, stream);
  auto dblock = upload(block, stream);
  auto dvalid = upload(valid, stream);
  auto dpool = upload(pool, stream);
  auto dq = upload(q, stream);
  gpu::DeviceBuffer<float> dout(q.size());
  LayerView<T> dv = view;
  dv.seq_ids = dids.data();
  dv.seq_len = dlens.data();
  dv.indptr = dindptr.data();
  dv.slot = dslot.data();
  dv.block = dblock.data();
  dv.valid_tokens = dvalid.data();
  dv.pool = dpool.data();
  gpu::reference::sparse_attention<T>(dv, nq, scale, dq.data(), dout.data(), stream);
  const auto got = download(dout, stream);
  for (std::size_t j = 0; j < got.size(); ++j) {
    CHECK(std::fabs(got[j] - expected[j]) <= 1e-3f * std::max(1.0f, std::fabs(expected[j])));
  }
}

}  // namespace

OASISKV_CUDA_TEST_CASE("cuda sparse attention matches the CPU reference (float)") { run_attention_test<float>(); }
OASISKV_CUDA_TEST_CASE("cuda sparse attention matches the CPU reference (fp16)") { run_attention_test<fp16_t>(); }
OASISKV_CUDA_TEST_CASE("cuda sparse attention matches the CPU reference (bf16)") { run_attention_test<bf16_t>(); }

OASISKV_CUDA_TEST_CASE("cuda errors become oasiskv::Error carrying the CUDA error name") {
  void* p = nullptr;
  try {
    OASISKV_CUDA_CHECK(cudaMalloc(&p, std::size_t{1} << 62));
    FAIL("cudaMalloc of 4 EiB succeeded");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("cudaErrorMemoryAllocation") != std::string::npos);
  }
  // The error was cleared: the next call works.
  gpu::DeviceBuffer<int> ok(16);
  CHECK(ok.data() != nullptr);
  CHECK_THROWS_AS(gpu::segmented_top_k(nullptr, 1, nullptr, nullptr, 1, 0, nullptr, nullptr, nullptr), Error);
}

OASISKV_CUDA_TEST_CASE("cuda DeviceGuard sets a device only when it differs and restores the previous one") {
  int before = -1;
  OASISKV_CUDA_CHECK(cudaGetDevice(&before));
  {
    gpu::DeviceGuard same(before);
    CHECK(same.previous() == before);
    int now = -1;
    OASISKV_CUDA_CHECK(cudaGetDevice(&now));
    CHECK(now == before);
  }
  const int other = gpu::device_count() > 1 ? (before + 1) % gpu::device_count() : before;
  {
    gpu::DeviceGuard g(other);
    int now = -1;
    OASISKV_CUDA_CHECK(cudaGetDevice(&now));
    CHECK(now == other);
  }
  int after = -1;
  OASISKV_CUDA_CHECK(cudaGetDevice(&after));
  CHECK(after == before);
  CHECK_THROWS_AS(gpu::DeviceGuard(gpu::device_count()), Error);  // no such device
}

OASISKV_CUDA_TEST_CASE("cuda DeviceBuffer::fill_async fills on the given stream only") {
  gpu::Stream stream;
  gpu::DeviceBuffer<std::int64_t> b(1000);
  b.fill_async(0xff, stream);
  const auto v = download(b, stream);
  CHECK(std::all_of(v.begin(), v.end(), [](std::int64_t x) { return x == -1; }));
  b.fill_async(0, stream);
  const auto z = download(b, stream);
  CHECK(std::all_of(z.begin(), z.end(), [](std::int64_t x) { return x == 0; }));
}

}  // namespace oasiskv::gpu_test
