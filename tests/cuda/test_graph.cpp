// One decode step of a small batch (append, scoring, top-K, planning, gather) captured into a CUDA
// graph and replayed: the same state as running it eagerly, step after step. The step makes no
// host synchronisation and no device-to-host copy, so capture succeeds.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cuda/cuda_support.hpp"
#include "oasiskv/oasiskv.hpp"
#include "oasiskv/cuda/components.cuh"
#include "oasiskv/cuda/ops.cuh"
#include "support.hpp"

namespace oasiskv::gpu_test {
namespace {

struct DeviceState {
  explicit DeviceState(const CacheLayout& L)
      : host(L),
        summ(static_cast<std::size_t>(L.config.max_sequences) * L.config.shape.num_layers * L.config.shape.num_kv_heads *
             static_cast<std::size_t>(L.max_blocks) * 2 * static_cast<std::size_t>(L.config.shape.head_dim)),
        pool(L),
        res_block(static_cast<std::size_t>(L.config.max_sequences) * L.config.shape.num_layers *
                  L.config.shape.num_kv_heads * static_cast<std::size_t>(L.selectable_blocks)),
        res_last(res_block.size()) {
    OASISKV_CUDA_CHECK(cudaMemset(res_block.data(), 0xff, res_block.bytes()));  // kNoBlock
    OASISKV_CUDA_CHECK(cudaMemset(res_last.data(), 0xff, res_last.bytes()));    // -1
  }
  gpu::PinnedHostTier<fp16_t> host;
  gpu::DeviceBuffer<float> summ;
  DeviceTier<cuda, fp16_t> pool;
  gpu::DeviceBuffer<std::int32_t> res_block;
  gpu::DeviceBuffer<std::int64_t> res_last;
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
  const gpu::Geometry g = gpu::Geometry::from(L);
  const int B = 4, H = 2, d = 64, nq = 8, K = L.selectable_blocks, pairs = B * H;
  DeviceState eager(L), graph(L);
  REQUIRE(eager.host.pinned());
  gpu::Stream stream;

  // Prefill (eager, identical on both states).
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<std::int32_t> slots{0, 1, 2, 3}, offsets{0};
  std::vector<std::int64_t> lens(4, 0);
  for (int i = 0; i < B; ++i) offsets.push_back(offsets.back() + 300 + 150 * i);
  std::vector<fp16_t> k(static_cast<std::size_t>(offsets.back() * H * d)), v(k.size());
  for (auto& x : k) x = to_fp16(dist(rng));
  for (auto& x : v) x = to_fp16(dist(rng));
  auto dslots = upload(slots);
  auto dzero = upload(lens);
  auto doff = upload(offsets);
  auto dk = upload(k);
  auto dv = upload(v);
  for (DeviceState* s : {&eager, &graph}) {
    gpu::append<fp16_t>(g, 0, gpu::DeviceBatch{B, dslots.data(), dzero.data()}, doff.data(), dk.data(), dv.data(),
                        s->host.device_base(), s->pool.layer_pool(0), s->summ.data(), stream);
  }
  for (int i = 0; i < B; ++i) lens[static_cast<std::size_t>(i)] = offsets[static_cast<std::size_t>(i) + 1] - offsets[static_cast<std::size_t>(i)];

  // Step inputs at fixed device addresses (what a captured graph reads at each replay).
  std::vector<std::int32_t> one_row{0, 1, 2, 3, 4};
  auto d_one_row = upload(one_row);
  std::vector<fp16_t> k1(static_cast<std::size_t>(B * H * d)), v1(k1.size());
  std::vector<float> q(static_cast<std::size_t>(B * nq * d));
  auto d_k1 = upload(k1);
  auto d_v1 = upload(v1);
  auto d_q = upload(q);
  gpu::DeviceBuffer<std::int64_t> d_before(4), d_after(4), d_steps(4);
  const int stride = static_cast<int>(L.max_blocks);
  gpu::DeviceBuffer<float> scores(static_cast<std::size_t>(pairs * stride));
  gpu::DeviceBuffer<std::int32_t> count(pairs), first(pairs), sel(static_cast<std::size_t>(pairs * K)), sel_count(pairs);
  gpu::DeviceBuffer<gpu::DeviceAdmit> admits(static_cast<std::size_t>(pairs * g.admit_stride));
  gpu::DeviceBuffer<std::int32_t> admit_count(pairs);

  auto step = [&](DeviceState& s) {
    gpu::append<fp16_t>(g, 0, gpu::DeviceBatch{B, dslots.data(), d_before.data()}, d_one_row.data(), d_k1.data(),
                        d_v1.data(), s.host.device_base(), s.pool.layer_pool(0), s.summ.data(), stream);
    const gpu::DeviceBatch now{B, dslots.data(), d_after.data()};
    gpu::score_blocks<float>(g, 0, now, d_q.data(), 1, s.summ.data(),
                             gpu::ScoreBuffers{scores.data(), count.data(), first.data(), nullptr, stride}, stream);
    gpu::segmented_top_k(scores.data(), stride, count.data(), first.data(), pairs, K, sel.data(), sel_count.data(),
                         stream);
    gpu::plan_transfers(g, 0, now, d_steps.data(), sel.data(), sel_count.data(), K, s.res_block.data(),
                        s.res_last.data(), gpu::PlanBuffers{admits.data(), admit_count.data(), nullptr, nullptr, nullptr},
                        stream);
    gpu::gather_admits<fp16_t>(g, 0, now, admits.data(), admit_count.data(), s.host.device_base(),
                               s.pool.layer_pool(0), stream);
  };
  auto set_inputs = [&](std::int64_t t) {
    for (auto& x : k1) x = to_fp16(dist(rng));
    for (auto& x : v1) x = to_fp16(dist(rng));
    for (auto& x : q) x = dist(rng);
    std::vector<std::int64_t> after(lens), steps(4, t);
    for (auto& n : after) n += 1;
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
    OASISKV_CUDA_CHECK(cudaMemcpy(d_k1.data(), k1.data(), k1.size() * sizeof(fp16_t), cudaMemcpyHostToDevice));
    OASISKV_CUDA_CHECK(cudaMemcpy(d_v1.data(), v1.data(), v1.size() * sizeof(fp16_t), cudaMemcpyHostToDevice));
    OASISKV_CUDA_CHECK(cudaMemcpy(d_q.data(), q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice));
    OASISKV_CUDA_CHECK(cudaMemcpy(d_before.data(), lens.data(), 4 * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    OASISKV_CUDA_CHECK(cudaMemcpy(d_after.data(), after.data(), 4 * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    OASISKV_CUDA_CHECK(cudaMemcpy(d_steps.data(), steps.data(), 4 * sizeof(std::int64_t), cudaMemcpyHostToDevice));
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
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
    INFO("step " << t);
    CHECK(std::memcmp(eager.host.base(), graph.host.base(), eager.host.bytes_reserved()) == 0);
    CHECK(download(eager.summ, eager.summ.size()) == download(graph.summ, graph.summ.size()));
    CHECK(download(eager.res_block, eager.res_block.size()) == download(graph.res_block, graph.res_block.size()));
    CHECK(download(eager.res_last, eager.res_last.size()) == download(graph.res_last, graph.res_last.size()));
    const auto pe = download(eager.pool.layer_pool(0), eager.pool.bytes_reserved() / sizeof(fp16_t));
    const auto pg = download(graph.pool.layer_pool(0), graph.pool.bytes_reserved() / sizeof(fp16_t));
    CHECK(std::memcmp(pe.data(), pg.data(), eager.pool.bytes_reserved()) == 0);
  }
  OASISKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
  OASISKV_CUDA_CHECK(cudaGraphDestroy(captured));
}

}  // namespace oasiskv::gpu_test
