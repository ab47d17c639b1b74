// One decode step of a small batch (append, scoring, top-K, planning, gather) captured into a CUDA
// graph and replayed: the same state as running it eagerly, step after step. The step makes no
// host synchronisation and no device-to-host copy, so capture succeeds. Inputs are written with
// cudaMemcpyAsync on the step's stream, before the eager step and the graph launch.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cuda/cuda_support.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/cuda/device_memory.hpp"
#include "oasiskv/cuda/ops.hpp"
#include "oasiskv/cuda/pinned_region.hpp"
#include "support.hpp"

namespace oasiskv::gpu_test {
namespace {

// Host tier (pinned, mapped), summaries, layer-0 slot pool and residency of one cache.
struct DeviceState {
  DeviceState(const CacheLayout& L, cudaStream_t stream)
      : host(static_cast<std::size_t>(L.host_tier_elements) * sizeof(fp16_t),
             static_cast<std::size_t>(L.block_elems) * sizeof(fp16_t)),
        summ(static_cast<std::size_t>(L.summary_floats)),
        pool(static_cast<std::size_t>(L.slots_per_layer * L.block_elems)),
        res_block(static_cast<std::size_t>(L.residency_entries)),
        res_last(res_block.size()),
        map(upload(identity_block_map(L), stream)) {
    summ.fill_async(0, stream);
    pool.fill_async(0, stream);
    res_block.fill_async(0xff, stream);  // kNoBlock
    res_last.fill_async(0xff, stream);   // -1
  }
  gpu::DeviceHostTier<fp16_t> host_device() const { return {reinterpret_cast<fp16_t*>(host.device_data()), map.data()}; }
  gpu::PinnedRegion host;
  gpu::DeviceBuffer<float> summ;
  gpu::DeviceBuffer<fp16_t> pool;
  gpu::DeviceBuffer<std::int32_t> res_block;
  gpu::DeviceBuffer<std::int64_t> res_last;
  gpu::DeviceBuffer<std::int32_t> map;  // identity_block_map
};

}  // namespace

OASISKV_CUDA_TEST_CASE("cuda one decode step captured in a CUDA graph and replayed matches eager execution") {
  OASISKV_SEEDED_RNG(rng);
  CacheConfig c;
  c.shape = ModelShape{1, 8, 2, 64};
  c.budget_tokens = 256;
  c.max_sequences = 4;
  c.max_tokens_per_sequence = 2048;
  c.fetch_ratio = 0.5;
  const CacheLayout L = CacheLayout::from(c);
  const int B = 4, H = 2, d = 64, nq = 8, K = L.selectable_blocks, pairs = B * H;
  gpu::Stream stream;
  DeviceState eager(L, stream), graph(L, stream);
  REQUIRE(eager.host.pinned());
  REQUIRE(graph.host.pinned());

  // Prefill (eager, identical on both states).
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<std::int32_t> slots{0, 1, 2, 3}, offsets{0};
  std::vector<std::int64_t> lens(4, 0);
  for (int i = 0; i < B; ++i) offsets.push_back(offsets.back() + 300 + 150 * i);
  std::vector<fp16_t> k(static_cast<std::size_t>(offsets.back() * H * d)), v(k.size());
  for (auto& x : k) x = to_fp16(dist(rng));
  for (auto& x : v) x = to_fp16(dist(rng));
  auto dslots = upload(slots, stream);
  auto dzero = upload(lens, stream);
  auto doff = upload(offsets, stream);
  auto dk = upload(k, stream);
  auto dv = upload(v, stream);
  for (DeviceState* s : {&eager, &graph}) {
    gpu::append<fp16_t>(L, 0, gpu::DeviceBatch{B, dslots.data(), dzero.data()}, doff.data(), dk.data(), dv.data(),
                        s->host_device(), s->pool.data(), s->summ.data(), stream);
  }
  for (int i = 0; i < B; ++i) {
    lens[static_cast<std::size_t>(i)] = offsets[static_cast<std::size_t>(i) + 1] - offsets[static_cast<std::size_t>(i)];
  }

  // Step inputs at fixed device addresses (what a captured graph reads at each replay).
  std::vector<std::int32_t> one_row{0, 1, 2, 3, 4};
  auto d_one_row = upload(one_row, stream);
  std::vector<fp16_t> k1(static_cast<std::size_t>(B * H * d)), v1(k1.size());
  std::vector<float> q(static_cast<std::size_t>(B * nq * d));
  gpu::DeviceBuffer<fp16_t> d_k1(k1.size()), d_v1(v1.size());
  gpu::DeviceBuffer<float> d_q(q.size());
  gpu::DeviceBuffer<std::int64_t> d_before(4), d_after(4), d_steps(4);
  gpu::DeviceBuffer<std::int32_t> d_caps(static_cast<std::size_t>(pairs));  // per pair
  const int stride = static_cast<int>(L.max_blocks);
  gpu::DeviceBuffer<float> scores(static_cast<std::size_t>(pairs * stride));
  gpu::DeviceBuffer<std::int32_t> count(pairs), first(pairs), sel(static_cast<std::size_t>(pairs * K)), sel_count(pairs);
  gpu::DeviceBuffer<gpu::DeviceAdmit> admits(static_cast<std::size_t>(pairs * K));
  gpu::DeviceBuffer<std::int32_t> admit_count(pairs);

  auto step = [&](DeviceState& s) {
    gpu::append<fp16_t>(L, 0, gpu::DeviceBatch{B, dslots.data(), d_before.data()}, d_one_row.data(), d_k1.data(),
                        d_v1.data(), s.host_device(), s.pool.data(), s.summ.data(), stream);
    const gpu::DeviceBatch now{B, dslots.data(), d_after.data()};
    gpu::score_blocks<float>(L, 0, now, d_q.data(), 1, s.summ.data(),
                             gpu::ScoreBuffers{scores.data(), count.data(), first.data(), nullptr, stride}, stream);
    gpu::segmented_top_k(scores.data(), stride, count.data(), first.data(), pairs, K, sel.data(), sel_count.data(),
                         stream);
    gpu::plan_transfers(L, 0, now, d_steps.data(), d_caps.data(), sel.data(), sel_count.data(), K, s.res_block.data(),
                        s.res_last.data(), gpu::PlanBuffers{admits.data(), admit_count.data(), nullptr, nullptr, nullptr},
                        stream);
    gpu::gather_admits<fp16_t>(L, 0, now, admits.data(), admit_count.data(), s.host_device(), s.pool.data(), stream);
  };
  // New inputs for step t, stream-ordered after the previous step's work (which read them).
  auto set_inputs = [&](std::int64_t t) {
    for (auto& x : k1) x = to_fp16(dist(rng));
    for (auto& x : v1) x = to_fp16(dist(rng));
    for (auto& x : q) x = dist(rng);
    std::vector<std::int64_t> after(lens), steps(4, t);
    for (auto& n : after) n += 1;
    upload_to(d_k1.data(), k1, stream);
    upload_to(d_v1.data(), v1, stream);
    upload_to(d_q.data(), q, stream);
    upload_to(d_before.data(), lens, stream);
    upload_to(d_after.data(), after, stream);
    upload_to(d_steps.data(), steps, stream);
    upload_to(d_caps.data(), std::vector<std::int32_t>(static_cast<std::size_t>(pairs), L.admit_cap(t)), stream);
    lens = after;
  };

  cudaGraph_t captured = nullptr;
  cudaGraphExec_t exec = nullptr;
  for (std::int64_t t = 0; t < 3; ++t) {
    set_inputs(t);
    step(eager);
    if (t == 0) {
      OASISKV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      step(graph);
      OASISKV_CUDA_CHECK(cudaStreamEndCapture(stream, &captured));
      OASISKV_CUDA_CHECK(cudaGraphInstantiate(&exec, captured, 0));
    }
    OASISKV_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    INFO("step " << t);
    const auto se = download(eager.summ, stream);  // synchronises: both host tiers are final
    CHECK(std::memcmp(eager.host.data(), graph.host.data(), eager.host.bytes()) == 0);
    CHECK(se == download(graph.summ, stream));
    CHECK(download(eager.res_block, stream) == download(graph.res_block, stream));
    CHECK(download(eager.res_last, stream) == download(graph.res_last, stream));
    const auto pe = download(eager.pool, stream);
    const auto pg = download(graph.pool, stream);
    CHECK(std::memcmp(pe.data(), pg.data(), eager.pool.bytes()) == 0);
  }
  OASISKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
  OASISKV_CUDA_CHECK(cudaGraphDestroy(captured));
}

}  // namespace oasiskv::gpu_test
